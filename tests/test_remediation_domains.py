"""Fault domains, fence-then-evict, node-wide faults, no amnesia (issue 16) against the HTTP
Kubernetes API emulation with ResourceSlices in the drivers' own formats (tests/fixtures/dra).

Real parts: the API emulation over HTTP with the strict kubernetes-validate validator, the
agent's HTTP client, SliceWatcher, health engine and remediator. Time is a ManualClock shared by
the health engine and the remediator; ``reconcile()`` is called directly, as the remediator's
thread does after every health change. Defaults: settle window 2 s, node-fault window 2 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clock_helpers import ManualClock
from k8s_helpers import running_apiserver, wait_until, write_kubeconfig
from validation import StrictValidator

from exporter.config import Config, TaintMode
from exporter.devices.model import DeviceEvent, DeviceIdentity, DeviceReading, EventKind, ReadError, RecoveryAction, Vendor
from exporter.health.engine import HealthEngine, HealthPolicy
from exporter.k8s import names
from exporter.k8s.connection import connect
from exporter.k8s.discovery import Discovery
from exporter.k8s.slices import SliceWatcher
from exporter.model.join import JoinInputs, join
from exporter.remediation.adoption import BootIdentity
from exporter.remediation.rails import LocalBudget
from exporter.wiring import build_remediator

FIXTURES = Path(__file__).parent / "fixtures" / "dra"
NODE = "node-a"
NS = "dra-gpu-exporter"
T0 = 1_750_000_000.0
HOLD = 600.0
POLICY = HealthPolicy(clear_hold=60.0)
SETTLE = 2.0
BOOT = BootIdentity("boot-1", T0 - 86400)  # the node's boot: the same for every agent process of a rig


def load(name: str):
    return json.loads((FIXTURES / name).read_text())


def nv_gpu(i: int) -> DeviceIdentity:
    """Local identity of the fixtures' NVIDIA GPU i (same uuid and bus id as the slices)."""
    return DeviceIdentity(uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444", vendor=Vendor.NVIDIA, model="NVIDIA H100 80GB HBM3",
                          pci_bus_id=f"0000:{0x18 + 0x10 * i:02x}:00.0", index=i, minor=i)


def nv_mig(dev: dict, parent: DeviceIdentity, n: int) -> DeviceIdentity:
    a = dev["attributes"]
    *_, gi, start = dev["name"].split("-")
    return DeviceIdentity(uuid=a["uuid"]["string"], vendor=Vendor.NVIDIA, model=parent.model, pci_bus_id=parent.pci_bus_id, index=n,
                          parent_uuid=parent.uuid, mig_profile=a["profile"]["string"], gi_profile_id=int(gi), placement_start=int(start))


def plain_gpus(n: int) -> tuple[list[dict], list[DeviceIdentity]]:
    ids = [nv_gpu(i) for i in range(n)]
    sl = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{NODE}-plain"},
          "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                   "devices": [{"name": f"gpu-{d.minor}", "attributes": {"uuid": {"string": d.uuid}, "resource.kubernetes.io/pciBusID": {"string": d.pci_bus_id}}} for d in ids]}}
    return [sl], ids


class Rig:
    def __init__(self, server, tmp: Path, slices: list[dict], local: list[DeviceIdentity], **cfg) -> None:
        self.server = server
        self.validator = StrictValidator("1.37")
        server.set_validator(self.validator)
        server.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        for s in slices:
            server.apply(s)
        self.api = connect(str(write_kubeconfig(tmp / "kubeconfig", server.url)))
        discovery = Discovery(self.api)
        self.watcher = SliceWatcher(self.api, NODE, discovery=discovery, backoff_initial=0.02, backoff_max=0.2)
        self.watcher.start()
        assert self.watcher.wait_synced(10)
        want = sum(len(s["spec"].get("devices", [])) for s in slices)
        wait_until(lambda: len(self.watcher.devices()) == want, timeout=10, message="every published device")
        self.local = local
        self.clock = ManualClock(T0)
        cfg.setdefault("taint_rate_limit", 2)
        self.cfg = Config(node_name=NODE, taint_mode=TaintMode.ENFORCE, taint_hold_seconds=HOLD, **cfg)
        self.restart()

    def restart(self, boot: BootIdentity | None = None) -> None:
        """A new agent process: fresh health engine and remediator, same cluster (``boot``: the
        node rebooted meanwhile)."""
        self.boot = boot or self.boot
        self.health = HealthEngine(self.clock, POLICY)
        self.health.set_topology(self.local)
        # Built by the production wiring (node-state ConfigMap in NS), rules listed and the Node read
        # every pass, a local budget; the snapshot carries the slices as the watcher holds them.
        self.rem = build_remediator(self.cfg, self.api, self.health, self.clock, 0.0, watch=False,
                                    budget=LocalBudget(self.cfg.taint_budget_max), boot=self.boot)
        self.rem.update(self.snapshot())

    boot = BOOT

    def snapshot(self):
        return join(JoinInputs(node=NODE, timestamp=self.clock.wall(), identities=tuple(self.local), readings={},
                               health={}, slices=self.watcher.devices()))

    def lost(self, i: int) -> None:
        """A collection cycle in which local device ``i`` is lost (NVML cannot reach it)."""
        readings = {d.uuid: DeviceReading(uuid=d.uuid, recovery_action=RecoveryAction.NONE, ecc_uncorrectable_total=0) for d in self.local}
        readings[self.local[i].uuid] = DeviceReading.failed(self.local[i].uuid, ReadError.LOST)
        self.health.observe(self.local, readings)

    def clean(self) -> None:
        """A collection cycle in which every local device reads fine."""
        readings = {d.uuid: DeviceReading(uuid=d.uuid, recovery_action=RecoveryAction.NONE, ecc_uncorrectable_total=0) for d in self.local}
        self.health.observe(self.local, readings)

    def xid(self, uuid: str, code: int = 79) -> None:
        self.health.on_event(DeviceEvent(uuid=uuid, kind=EventKind.XID, code=code, detail="test"))

    def reconcile(self, times: int = 1) -> None:
        for _ in range(times):
            self.rem.update(self.snapshot())  # the sampler hands the remediator each cycle's snapshot
            self.rem.reconcile()

    def rules(self) -> list[dict]:
        return self.server.list("resource.k8s.io", "devicetaintrules")

    def effects(self) -> dict[str, str]:
        out = {}
        for r in self.rules():
            dev = r["spec"]["deviceSelector"]["device"]
            assert dev not in out, f"two rules for {dev}"
            out[dev] = r["spec"]["taint"]["effect"]
        return out

    def events(self, reason: str | None = None) -> list[dict]:
        evs = self.server.list("events.k8s.io", "events", namespace="default")
        evs.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))
        return [e for e in evs if reason is None or e["reason"] == reason]

    def close(self) -> None:
        self.rem.stop()
        self.watcher.stop()
        assert self.validator.failures == []


@pytest.fixture
def make_rig(tmp_path):
    made, cms = [], []

    def make(slices, local, **kw) -> Rig:
        cm = running_apiserver("1.37", bookmark_interval=3600)
        server = cm.__enter__()
        cms.append(cm)
        rig = Rig(server, tmp_path, slices, local, **kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()
    for cm in cms:
        cm.__exit__(None, None, None)


# ------------------------------------------------------------------------------ fault domains


def static_mig_rig(make_rig, **kw) -> tuple[Rig, list[str]]:
    sl = load("nvidia-static-mig.json")
    g0, g1 = nv_gpu(0), nv_gpu(1)
    migs = [nv_mig(d, g0, n) for n, d in enumerate(d for d in sl["spec"]["devices"] if d["attributes"]["type"]["string"] == "mig")]
    rig = make_rig([sl], [g0, g1, *migs], **kw)
    return rig, [d["name"] for d in sl["spec"]["devices"] if d["name"].startswith("gpu-0-mig-")]


def test_xid79_on_a_static_mig_parent_fences_then_evicts_every_mig_device_counted_once(make_rig):
    """Regression (issue 16, 1): the rate limit of 2 was spent device by device in name order,
    so two 1g.10gb instances got NoExecute and the held 2g/3g instances NoSchedule only."""
    rig, migs = static_mig_rig(make_rig, taint_rate_limit=1)
    assert len(migs) == 4
    rig.xid(nv_gpu(0).uuid)
    rig.reconcile()
    # fenced at once: every device of the domain, nothing new lands on it
    assert rig.effects() == {m: "NoSchedule" for m in migs}
    (tainted,) = rig.events("GPUTainted")  # one decision, one Event for the domain
    assert all(m in tainted["note"] for m in migs) and "4 devices" in tainted["note"]
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {m: "NoExecute" for m in migs}  # whole, not by name order
    assert len(rig.events("GPUTaintEscalated")) == 1
    assert rig.rem.report().suppressed == {}
    # the rate limit (1 per window) was spent once, by the domain: a second GPU failing a minute
    # later (not node-wide) is limited
    rig.clock.advance(60)
    rig.xid(nv_gpu(1).uuid)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects()["gpu-1"] == "NoSchedule" and rig.rem.report().suppressed == {"rate_limit": 1}
    for r in rig.rules():
        if r["spec"]["deviceSelector"]["device"] in migs:
            ann = r["metadata"]["annotations"]
            assert ann[names.GPU_ANNOTATION] == nv_gpu(0).uuid and ann[names.SCOPE_ANNOTATION] == "gpu"
            assert ann[names.TIER_ANNOTATION] == "fatal" and ann[names.RESET_REQUIRED_ANNOTATION] == "true"


def test_dynamic_mig_every_partition_and_the_full_gpu_are_one_domain(make_rig):
    slices = load("nvidia-dynamic-mig.json")
    rig = make_rig(slices, [nv_gpu(0), nv_gpu(1)], taint_rate_limit=1)
    gpu0 = sorted(d["name"] for d in slices[1]["spec"]["devices"])
    assert len(gpu0) == 19 and "gpu-0" in gpu0
    rig.xid(nv_gpu(0).uuid)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {d: "NoExecute" for d in gpu0}  # GPU 1's devices untouched
    assert len(rig.events("GPUTainted")) == 1 and len(rig.events("GPUTaintEscalated")) == 1
    assert rig.rem.report().suppressed == {}


def test_amd_partitions_of_one_gpu_are_one_domain(make_rig):
    sl = load("amd-partitioned.json")
    local = []
    for g in range(2):
        first = None
        for p in range(4):
            card, render = 1 + g * 4 + p, 128 + g * 4 + p
            uuid = f"amd-{g}-{p}"
            first = first or uuid
            local.append(DeviceIdentity(uuid=uuid, vendor=Vendor.AMD, model="AMD Instinct MI300X", pci_bus_id=f"0000:{0x11 + 0x20 * g:02x}:00.0",
                                        index=g * 4 + p, parent_uuid=first, card_index=card, render_index=render))
    rig = make_rig([sl], local)
    rig.xid("amd-1-0")  # a fault of GPU 1 (its first partition stands for the GPU)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {f"gpu-{c}-{r}": "NoExecute" for c, r in ((5, 132), (6, 133), (7, 134), (8, 135))}
    assert len(rig.events("GPUTainted")) == 1


# ------------------------------------------------------------------------------ node-wide


def test_six_of_eight_gpus_failing_within_half_a_second_get_no_noexecute(make_rig):
    """Regression (issue 16, 6): the first two got NoExecute before the node-wide fault was seen."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    for i in range(6):
        rig.xid(ids[i].uuid)
        rig.reconcile()  # the remediator's thread runs after every health change
        rig.clock.advance(0.1)
    for _ in range(5):
        rig.clock.advance(SETTLE)
        rig.reconcile()
    assert rig.effects() == {f"gpu-{i}": "NoSchedule" for i in range(6)}
    assert rig.rem.report().suppressed == {"node_fault": 1}
    (ev,) = rig.events("HealthRemediationSuppressed")
    assert "of 8 GPUs failed within 2s" in ev["note"]  # told once, when the majority was reached


def test_on_a_4_gpu_node_a_second_gpu_failing_a_minute_later_is_evicted(make_rig):
    """Regression (issue 16, 6): half counted as most, and timing was ignored."""
    slices, ids = plain_gpus(4)
    rig = make_rig(slices, ids)
    rig.xid(ids[0].uuid)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"}
    rig.clock.advance(60)
    rig.xid(ids[1].uuid)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute", "gpu-1": "NoSchedule"}  # fenced
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute", "gpu-1": "NoExecute"}
    assert rig.rem.report().suppressed == {}


def test_the_remediator_thread_raises_after_the_settle_window_by_itself(make_rig, tmp_path):
    """No further health change or cycle comes: the loop wakes when the raise is due."""
    from exporter.clock import SYSTEM

    slices, ids = plain_gpus(4)
    rig = make_rig(slices, ids, taint_settle_seconds=0.5, node_fault_window=0.5)
    rig.clock = SYSTEM  # the real clock, for the thread
    rig.restart()
    rig.rem.start()
    rig.xid(ids[2].uuid)
    wait_until(lambda: rig.effects() == {"gpu-2": "NoSchedule"} or rig.effects() == {"gpu-2": "NoExecute"}, timeout=10, message="the fence")
    wait_until(lambda: rig.effects() == {"gpu-2": "NoExecute"}, timeout=20, message="the raise after the settle window")


def test_a_quiet_node_asks_for_no_pass_per_cycle_and_a_fault_still_wakes_the_remediator(make_rig):
    """Every device healthy, no rule held: a cycle's snapshot asks for no pass (at a 1 s interval
    that pass was a tenth of an 8-GPU node's CPU); a health change asks at once, and while a
    rule stands every cycle asks again (holds and step-downs are timed)."""
    slices, ids = plain_gpus(4)
    rig = make_rig(slices, ids)
    snap = join(JoinInputs(node=NODE, timestamp=rig.clock(), identities=tuple(ids), readings={}, health={}))
    rig.clean()
    rig.reconcile()
    assert rig.rem.quiet and rig.effects() == {}
    rig.reconcile()  # the thread's own pass, as after a poke: asks for nothing more
    rig.rem.update(snap)
    assert not rig.rem.pass_pending
    rig.xid(ids[1].uuid)  # the health engine's subscription, not the next cycle
    assert rig.rem.pass_pending
    rig.reconcile()
    assert not rig.rem.quiet and rig.effects() == {"gpu-1": "NoSchedule"}
    rig.reconcile()
    rig.rem.update(snap)
    assert rig.rem.pass_pending
    # new devices (a MIG layout change, a GPU back) ask for a pass even on a quiet node
    slices, other_ids = plain_gpus(2)
    quiet = make_rig(slices, other_ids)
    quiet.clean()
    quiet.reconcile()
    assert quiet.rem.quiet
    quiet.reconcile()
    quiet.rem.update(join(JoinInputs(node=NODE, timestamp=quiet.clock(), identities=tuple(other_ids[:1]), readings={}, health={})))
    assert quiet.rem.pass_pending


# ------------------------------------------------------------------------------ no amnesia


def test_an_admins_deletion_is_remembered_across_restarts(make_rig):
    """Regression (issue 16, 4): a rule an admin deleted was recreated 8 s after a restart."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    rig.lost(0)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.lost(0)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"}
    (rule,) = rig.rules()
    rig.server.delete("resource.k8s.io", "devicetaintrules", rule["metadata"]["name"])
    rig.reconcile(2)
    assert rig.rules() == []
    cm = rig.server.list("", "configmaps", namespace=NS)
    assert [c["metadata"]["name"] for c in cm] == [names.node_state_name(NODE)]
    cm_writes = lambda: [q for q in rig.server.requests if "/configmaps" in q.path and q.method in ("POST", "PUT")]  # noqa: E731
    assert len(cm_writes()) == 1  # written once, when it changed
    # a new process; the GPU is still lost (the same evidence, seen again by the new process)
    rig.rem.stop()
    rig.restart()
    for _ in range(3):
        rig.lost(0)
        rig.reconcile()
        rig.clock.advance(SETTLE)
    assert rig.rules() == []
    assert len(cm_writes()) == 1
    # new evidence is acted on, and the deletion is forgotten
    rig.xid(ids[0].uuid)
    rig.lost(0)
    rig.reconcile()
    # (the domain has been fatal for longer than the settle window: no fence first)
    assert rig.effects() == {"gpu-0": "NoExecute"}
    assert len(cm_writes()) == 2


def test_a_fatal_rule_is_kept_after_a_restart_until_a_reset_is_observed(make_rig):
    """Regression (issue 16, 4): a restarted agent reported the GPU healthy at once and stepped
    the rule down after the hold, although no reset happened."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    rig.xid(ids[0].uuid, 48)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"}
    rig.rem.stop()
    rig.restart()
    for _ in range(3):  # clean readings, hold after hold, but no reset
        rig.clean()
        rig.reconcile()
        rig.clock.advance(HOLD)
    assert rig.effects() == {"gpu-0": "NoExecute"}
    assert not rig.health.health(ids[0].uuid).healthy  # and the metrics agree with the rule
    rig.health.on_event(DeviceEvent(uuid=ids[0].uuid, kind=EventKind.RESET))
    rig.clock.advance(POLICY.clear_hold)
    rig.clean()
    assert rig.health.health(ids[0].uuid).healthy
    rig.reconcile()
    rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoSchedule"}  # now it steps down


def test_an_instance_scoped_fault_touches_only_that_instance(make_rig):
    """A condition the health engine scopes to one MIG instance (an XID NVML attributes to its
    GPU/compute instance, the instance's own ECC) covers that instance's device only: no
    sibling's rule, no parent's. (The condition is put in through HealthEngine.restore, the
    agreed way to create one on a given device.)"""
    from exporter.health.model import Tier

    rig, migs = static_mig_rig(make_rig)
    target = next(m for m in migs if "2g20gb" in m)
    inst = next(i for i in rig.local if i.parent_uuid and i.gi_profile_id == 14)
    rig.health.restore(inst.uuid, "xid_94", Tier.FATAL, rig.clock(), "XID 94 on GI 1 CI 0", True)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {target: "NoExecute"}
    assert rig.health.health(nv_gpu(0).uuid).healthy  # the parent is not booked
    (r,) = rig.rules()
    assert r["metadata"]["annotations"][names.SCOPE_ANNOTATION] == "instance"


# ------------------------------------------------------------------------------ release after a reboot (issue 26)


def fatal_rule_then_stop(rig: Rig, ids) -> dict:
    rig.xid(ids[0].uuid, 79)
    rig.reconcile()
    rig.clock.advance(SETTLE)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"}
    (rule,) = rig.rules()
    rig.rem.stop()
    return rule


def test_a_fatal_rule_from_before_a_reboot_is_released_after_the_clear_time_and_holds(make_rig):
    """XID 79's remedy is a reboot: a restarted agent proves it by the node's boot id, counts it
    as the reset the fatal rule waits for, and steps the rule down and removes it after the clear
    time and the holds, like a reset it had seen itself."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    rule = fatal_rule_then_stop(rig, ids)
    ann = rule["metadata"]["annotations"]
    assert ann[names.BOOT_ID_ANNOTATION] == "boot-1" and ann[names.RESET_REQUIRED_ANNOTATION] == "true"
    rig.clock.advance(600)  # the node reboots
    rig.restart(BootIdentity("boot-2", rig.clock() - 60))
    rig.clean()
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoExecute"}  # adopted, not dropped: the clear time runs first
    assert not rig.health.health(ids[0].uuid).healthy
    rig.clock.advance(POLICY.clear_hold)
    rig.clean()
    assert rig.health.health(ids[0].uuid).healthy  # the reset was booked on adoption
    rig.reconcile()
    rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoSchedule"}
    down = rig.rules()[0]["metadata"]["annotations"]
    assert down[names.RESET_REQUIRED_ANNOTATION] == "false" and down[names.BOOT_ID_ANNOTATION] == "boot-1"  # the fault's boot stays
    # a restart while it steps down (same new boot) does not trap it again
    rig.rem.stop()
    rig.restart()
    rig.clean()
    rig.reconcile()
    assert rig.effects() == {"gpu-0": "NoSchedule"}
    rig.clock.advance(POLICY.clear_hold)
    rig.clean()
    rig.reconcile()
    rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.rules() == []
    assert len(rig.events("GPUTaintSteppedDown")) == 1 and len(rig.events("GPUUntainted")) == 1
    assert not [q for q in rig.server.requests if q.method == "PUT" and "/devicetaintrules" in q.path]


def test_the_same_rule_under_the_same_boot_stays_noexecute(make_rig):
    """No amnesia: a restart without a reboot proves no reset; the fatal rule holds."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    fatal_rule_then_stop(rig, ids)
    rig.restart(BootIdentity("boot-1", T0 - 86400))
    for _ in range(4):
        rig.clean()
        rig.reconcile()
        rig.clock.advance(HOLD)
    assert rig.effects() == {"gpu-0": "NoExecute"} and not rig.health.health(ids[0].uuid).healthy


@pytest.mark.parametrize("booted_after_first_seen,released", [(True, True), (False, False)])
def test_a_rule_without_a_boot_annotation_is_released_when_first_seen_before_the_boot(make_rig, booted_after_first_seen, released):
    """A rule written by an older agent carries no boot id: its fault's first-seen time, older
    than the node's boot, is the proof; a fault first seen after the boot proves nothing."""
    slices, ids = plain_gpus(8)
    rig = make_rig(slices, ids)
    rule = fatal_rule_then_stop(rig, ids)
    del rule["metadata"]["annotations"][names.BOOT_ID_ANNOTATION]
    rig.server.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", **rule})
    first_seen = T0  # (the XID came at the rig's start)
    rig.clock.advance(600)
    rig.restart(BootIdentity("boot-2", first_seen + 300 if booted_after_first_seen else first_seen - 300))
    for _ in range(3):
        rig.clean()
        rig.reconcile()
        rig.clock.advance(HOLD)
    rig.reconcile()
    assert rig.effects() == ({"gpu-0": "NoSchedule"} if released else {"gpu-0": "NoExecute"})


def test_the_boot_identity_is_read_from_procfs_and_proves_only_what_it_can(tmp_path):
    from exporter.remediation.adoption import read_boot_identity

    (tmp_path / "boot_id").write_text("3f1c2b7e-9a43-4c55-8a0e-5b8d7f1e2a90\n")
    (tmp_path / "stat").write_text("cpu  1 2 3 4\nintr 5\nbtime 1750000000\nprocesses 9\n")
    b = read_boot_identity(tmp_path / "boot_id", tmp_path / "stat")
    assert b == BootIdentity("3f1c2b7e-9a43-4c55-8a0e-5b8d7f1e2a90", 1_750_000_000.0)
    assert b.reset_since("another-boot", None) and not b.reset_since(b.boot_id, 0.0)  # the annotation decides when present
    assert b.reset_since("", 1_749_999_999.0) and not b.reset_since("", 1_750_000_001.0) and not b.reset_since("", None)
    unknown = read_boot_identity(tmp_path / "missing", tmp_path / "missing")
    assert unknown == BootIdentity() and not unknown.reset_since("any", 0.0) and not unknown.reset_since("", 0.0)
    real = read_boot_identity()  # this machine's (Linux)
    assert len(real.boot_id) == 36 and real.booted_at is not None and real.booted_at < T0 * 2
