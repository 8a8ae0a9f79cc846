"""The rendezvous contract on the file backend: node processes sharing a FileStore directory."""

from __future__ import annotations

import os

import pytest

from _clusters import ProcessCluster
from rendezvous_contract import RendezvousContract

from rdzv.rendezvous._file import store_path
from rdzv.store._file import FileStore


class TestFileBackend(RendezvousContract):
    @pytest.fixture
    def cluster(self, tmp_path):
        directory = str(tmp_path / "rdzv")
        os.makedirs(directory)
        cluster = ProcessCluster(
            "file", directory,
            raw_store=lambda: FileStore(store_path(directory, "job"), timeout=30),
            hung_options={"heartbeat_interval": 0.3, "heartbeat_misses": 3},
            # a killed node is noticed by the others' session probe, every ttl / 3 seconds
            heartbeat_interval=0.5, heartbeat_misses=3,
        )
        yield cluster
        cluster.close()
