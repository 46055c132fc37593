"""GPUs the device library sees that no ResourceSlice of this node publishes (issue 32, Deliver 3).

A GPU node whose DRA kubelet plugin is not running (or missed a GPU) publishes nothing for it:
the scheduler cannot allocate it and nothing else says so (NVIDIA/aicr #2471, a "split
cluster"). The whole agent runs on the simulated node (production wiring, the real gRPC kubelet,
the HTTP API emulation): 8 GPUs with a slice that publishes 6, then no slice at all, then a node
whose GPU in MIG mode is published only through its MIG devices. The alert on the gauge is
unit-tested with promtool (alerts/tests/taints.test.yml).
"""

from __future__ import annotations

import yaml
from kit_helpers import fetch, scrape_samples, wait_until

from drasim.backend import SimClock
from drasim.node import SimulatedNode
from drasim.scenario import DRIVER, parse_scenario

assert DRIVER == "gpu.nvidia.com"  # the simulated node's slice is NVIDIA's

NVIDIA = DRIVER


def scenario(text: str):  # type: ignore[no-untyped-def]
    return parse_scenario(yaml.safe_load(text))


def unpublished(url: str) -> dict[str, float]:
    return {labels["driver"]: v for labels, v in scrape_samples(url).get("dra_unpublished_devices", [])}


EIGHT = "name: eight\nnode: split-node\ngpus:\n" + "".join(
    f"  - {{name: gpu{i}{', published: false' if i in (5, 7) else ''}}}\n" for i in range(8)
)


def test_eight_gpus_six_published_then_no_slice_at_all() -> None:
    sc = scenario(EIGHT)
    with SimulatedNode(sc, SimClock(1.0)) as node:
        node.start()
        agent = node.start_agent(interval=0.2)
        assert agent.server is not None
        url = agent.server.url
        wait_until(lambda: unpublished(url) == {NVIDIA: 2}, 30, message="2 of 8 GPUs unpublished")
        ready, detail = agent.readiness()
        assert ready and "2 GPU(s) seen by the device library but published by no gpu.nvidia.com ResourceSlice" in detail
        # The published six still resolve: nothing is "unresolved" (the opposite case)
        assert {lb["driver"]: v for lb, v in scrape_samples(url)["dra_unresolved_devices"]} == {NVIDIA: 0}

        # the kubelet plugin gone: its slice deleted, every GPU invisible to the scheduler
        slice_name = node.api.list("resource.k8s.io", "resourceslices")[0]["metadata"]["name"]
        assert node.api.delete("resource.k8s.io", "resourceslices", slice_name)
        wait_until(lambda: unpublished(url) == {NVIDIA: 8}, 30, message="all 8 GPUs unpublished")
        status, body = fetch(url + "/readyz")
        text = body.decode()
        # still ready (device metrics are worth scraping), and it says why the GPUs are missing
        assert status == 200 and "ready (degraded)" in text, text
        assert "8 GPU(s) seen by the device library but published by no gpu.nvidia.com ResourceSlice" in text, text
        assert "kubelet plugin running" in text


def test_a_gpu_in_mig_mode_is_published_through_its_mig_devices() -> None:
    sc = scenario(
        """
name: mig
node: mig-node
gpus:
  - {name: gpu0}
  - {name: gpu1, mig: [{profile: 3g.40gb, placement_start: 0}, {profile: 3g.40gb, placement_start: 4}]}
  - {name: gpu2, published: false, mig: [{profile: 7g.80gb, placement_start: 0}]}
"""
    )
    with SimulatedNode(sc, SimClock(1.0)) as node:
        node.start()
        agent = node.start_agent(interval=0.2)
        assert agent.server is not None
        url = agent.server.url
        # gpu1's parent is not itself in the slice, its MIG devices are: published. gpu2 and its
        # MIG device are not: one physical GPU unpublished, not two devices.
        wait_until(lambda: unpublished(url) == {NVIDIA: 1}, 30, message="the unpublished MIG GPU counted once")
        snap = agent.snapshot
        assert snap is not None and {p.gpu for p in snap.published or ()} == {sc.gpus[0].uuid, sc.gpus[1].uuid}


def test_no_kubernetes_api_no_series() -> None:
    """Without the slices listed nothing can be told: the gauge is absent, not 8 or 0."""
    sc = scenario(EIGHT)
    with SimulatedNode(sc, SimClock(1.0)) as node:
        node.start()
        agent = node.build_agent(kubeconfig=None)
        agent.run_cycle()
        snap = agent.snapshot
        assert snap is not None and snap.published is None and snap.unpublished == {}
        assert snap.unpublished_notes() == []
