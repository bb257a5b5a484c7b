"""Ray Serve's request router for the replicas: prefer the replicas whose own residency series hold
the request's adapter (api/fleet/residency_signal.py), GPU first, then the host cache, then a free
slot; within a group Ray picks the replica with the shortest queue that has room, and a full group
spills to the next one (a hot adapter then loads on a second replica).

Each replica reports `record_routing_stats()` (api/fleet/replica.py): its /metrics, parsed. Ray asks
every `ROUTING_STATS_PERIOD_S`, so an adapter loaded or evicted moves the routing within about that.
Requests without a model id (base model, non-inference routes) go to any replica, least loaded.
"""

from __future__ import annotations

import random

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from api.fleet.residency_signal import ReplicaResidency, rank_by_residency

ROUTING_STATS_PERIOD_S = 1.0


class ResidencyRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        model_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        ranks = rank_by_residency(
            candidate_replicas, lambda r: ReplicaResidency.from_stats(r.routing_stats), model_id
        )
        for rank in ranks:
            random.shuffle(rank)  # equal queues: no replica is always first
        return ranks


def residency_router_config() -> RequestRouterConfig:
    return RequestRouterConfig(
        request_router_class=ResidencyRouter,
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=5.0,
    )
