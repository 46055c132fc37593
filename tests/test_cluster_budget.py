"""ClusterBudget: the cluster NoExecute budget on one ConfigMap, against the HTTP API emulation
(issue 13). Optimistic concurrency, not counting: 150 agents taking at once get exactly the
capacity; release returns it; an unreadable object raises so the caller fails safe."""

from __future__ import annotations

import threading
import time

import pytest
from k8s_helpers import running_apiserver, wait_until, write_kubeconfig

from exporter.k8s.budget import BUDGET_NAME, ClusterBudget, capacity_of, holder_key
from exporter.k8s.connection import ApiError, ApiUnavailable, connect

NS = "dra-gpu-exporter"


def _budget_object(data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": BUDGET_NAME, "namespace": NS}, "data": data}


@pytest.mark.parametrize(
    ("data", "default", "want"),
    [
        ({}, 16, 16),  # nothing stated: the agent's flag
        ({"max_domains": "0", "fraction": "0.05", "cluster_gpus": "0"}, 16, 16),  # the chart's defaults
        ({"max_domains": "5"}, 16, 5),
        ({"fraction": "0.05", "cluster_gpus": "1000"}, 16, 50),
        ({"max_domains": "20", "fraction": "0.05", "cluster_gpus": "1000"}, 16, 20),
        ({"fraction": "0.001", "cluster_gpus": "10"}, 16, 1),  # at least one
        ({"max_domains": "many", "fraction": "x", "cluster_gpus": "?"}, 7, 7),  # garbage: the flag
    ],
)
def test_capacity_is_the_smallest_stated_cap(data: dict[str, str], default: int, want: int) -> None:
    assert capacity_of(data, default) == want


def test_holder_keys_are_valid_configmap_keys() -> None:
    assert holder_key("node-a.GPU-1234") == "node-a.GPU-1234"
    assert holder_key("node-a.pci/0000:3b:00.0") == "node-a.pci_0000_3b_00.0"


def test_many_agents_at_once_take_exactly_the_capacity_and_give_it_back(tmp_path) -> None:
    agents, capacity = 150, 9
    with running_apiserver("1.37") as server:
        server.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        server.apply(_budget_object({"max_domains": str(capacity), "fraction": "0.05", "cluster_gpus": "0"}))
        kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", server.url))
        budgets = [ClusterBudget(connect(kubeconfig), NS) for _ in range(agents)]
        # The first write is held: the agents that read meanwhile all hold the same version, so
        # the race happens however the machine schedules 150 threads (a busy machine could
        # otherwise serialize them and no write would ever conflict).
        server.delay_next(rf"/configmaps/{BUDGET_NAME}$", 5.0, count=1, method="PUT")
        start = threading.Barrier(agents)
        results: dict[int, bool] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                start.wait(timeout=60)
                deadline = time.monotonic() + 240
                while True:
                    try:
                        results[i] = budgets[i].take(f"node-{i:03d}.GPU-{i}")
                        return
                    except ApiUnavailable:
                        # 150 requests at once on a busy machine: the emulation may answer
                        # late (a watch's list too; it is retried with its backoff). The
                        # remediator retries on its next pass; so does this agent (a PUT whose
                        # answer was lost finds its key and counts as taken).
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(agents)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert errors == []
        winners = sorted(i for i, ok in results.items() if ok)
        assert len(results) == agents
        assert len(winners) == capacity  # exactly, never more
        assert sum(b.conflicts for b in budgets) > 0, "the race was real: some agents met a 409 and read again"
        assert budgets[0].held() == {f"node-{i:03d}.GPU-{i}" for i in winners}
        stored = server.get("", "configmaps", BUDGET_NAME, namespace=NS)["data"]
        assert stored["max_domains"] == str(capacity)  # the installer's keys are untouched

        # taking again is idempotent for a holder; a full budget says no
        w = winners[0]
        assert budgets[w].take(f"node-{w:03d}.GPU-{w}") is True
        loser = next(i for i in range(agents) if i not in winners)
        assert budgets[loser].take(f"node-{loser:03d}.GPU-{loser}") is False

        # one slot returned: the next agent gets it (once its watch shows the free slot, at its
        # random turn within the spread: until then take() answers False without asking)
        budgets[w].release(f"node-{w:03d}.GPU-{w}")
        assert wait_until(lambda: budgets[loser].take(f"node-{loser:03d}.GPU-{loser}"), timeout=60, message="the freed slot") is True
        assert budgets[0].held(prefix=f"node-{loser:03d}.") == {f"node-{loser:03d}.GPU-{loser}"}
        for i in [*winners[1:], loser]:
            budgets[i].release(f"node-{i:03d}.GPU-{i}")
        assert budgets[0].held() == set()
        for b in budgets:
            b.close()  # (the refused ones still watch the object)


def test_a_missing_budget_object_raises_so_the_caller_fails_safe(tmp_path) -> None:
    with running_apiserver("1.37") as server:
        kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", server.url))
        budget = ClusterBudget(connect(kubeconfig), NS)
        with pytest.raises(ApiError) as err:
            budget.take("node-a.GPU-1")
        assert err.value.status == 404
