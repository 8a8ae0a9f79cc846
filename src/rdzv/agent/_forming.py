"""What a node tells the person while its next round forms: how long it has waited, how many
nodes joined, the last call (said when it begins, with the option that sets it), and whether it
waits as a spare; a line every ``EVERY`` seconds otherwise. Its executor calls :meth:`tick`."""

from __future__ import annotations

from .._patience import EVERY
from ..errors import RendezvousError
from ._host import NodeHost


class Forming:
    """The console of one node's waits for its rounds (one wait at a time)."""

    def __init__(self, agent: NodeHost) -> None:
        self._agent = agent
        self._clock = agent.clock
        self.since = self._clock.monotonic()
        """When this node began to wait for the round forming now (or formed last)."""
        self._said = 0.0
        self._last_call_said = False
        self.spare = False
        """This node waits as a spare (as last seen)."""

    def begin(self) -> None:
        """A new wait for a round begins."""
        self.since = self._said = self._clock.monotonic()
        self._last_call_said = False

    def tick(self, survivors: bool) -> None:
        """Say what is news, or what is due (``survivors``: this node's workers wait, their
        group broken, for the round to form)."""
        agent, config, now = self._agent, self._agent.config, self._clock.monotonic()
        try:
            spare = agent.handler.is_spare()
        except RendezvousError:
            spare = self.spare
        if spare != self.spare:
            self.spare = spare
            if spare:
                agent.say(f"waiting as a spare: the job runs at its maximum of "
                          f"{config.max_nodes} node(s); this node takes the place of one that "
                          "leaves or is lost")
        forming = getattr(agent.handler, "forming", lambda: None)()
        last_call = forming is not None and forming[1] is not None
        news = last_call and not self._last_call_said  # the last call began: said at once
        if spare or (not news and now - self._said < EVERY):
            return
        self._said, self._last_call_said = now, last_call
        waited = now - self.since
        joined = "" if forming is None else (
            f": {forming[0]} joined, {config.min_nodes} needed" if forming[1] is None else
            f": {forming[0]} joined (min {config.min_nodes} reached); the last call waits "
            f"{forming[1]:.0f} s more for up to {config.max_nodes} (--rdzv-conf "
            "last_call_timeout=SECONDS)")
        if survivors:
            agent.say(f"the survivors wait for enough nodes to re-form ({waited:.0f} s{joined}); "
                      "training resumes in-process then")
        else:
            agent.say(f"still waiting for nodes ({waited:.0f} s){joined}")
