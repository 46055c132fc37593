"""Every metric the exporter serves: name, type, labels and help, in one place.

The renderer builds its families from this table and a test checks that the metric
reference (docs/metrics.md) lists exactly these names, so the documentation cannot drift from the code.
Every series also carries ``node``; it is added by the renderer and not repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .reasons import documented as suppression_reasons


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # gauge | counter | histogram | info
    labels: tuple[str, ...]
    help: str


def _m(name: str, kind: str, labels: str, help: str) -> MetricDef:
    return MetricDef(name, kind, tuple(x for x in labels.split(",") if x), help)


#: dra_device_taint_info's source for this agent's own DeviceTaintRules (a driver's taints: the driver's name)
OUR_TAINT_SOURCE = "dra-gpu-exporter"

U = "uuid"
CATALOG: tuple[MetricDef, ...] = (
    # devices
    _m("gpu_info", "gauge", "uuid,vendor,model,pci_bus_id,driver_version,parent_uuid,mig_profile,index,gpu_instance_id",
       "1 per device (full GPU, MIG instance or partition); index: the GPU's index in the device library "
       "(nvidia-smi, amd-smi), a MIG instance's or partition's is its GPU's; gpu_instance_id: the MIG GPU instance "
       "id"),
    _m("gpu_up", "gauge", U, "1 when the device was read successfully in the last cycle"),
    _m("gpu_utilization_ratio", "gauge", U, "Share of time a kernel was running (MIG: GPM SM activity), 0..1"),
    _m("gpu_memory_used_bytes", "gauge", U, "Device memory in use"),
    _m("gpu_memory_total_bytes", "gauge", U, "Device memory size"),
    _m("gpu_power_watts", "gauge", U, "Board power draw"),
    _m("gpu_energy_joules_total", "counter", U, "Energy consumed since the driver loaded"),
    _m("gpu_temperature_celsius", "gauge", U, "GPU core temperature"),
    _m("gpu_memory_temperature_celsius", "gauge", U, "Memory (HBM) temperature"),
    _m("gpu_sm_clock_hertz", "gauge", U, "SM clock"),
    _m("gpu_memory_clock_hertz", "gauge", U, "Memory clock"),
    _m("gpu_clock_event_reasons", "gauge", U, "Bitmask of active clock event (throttle) reasons, NVML encoding"),
    _m("gpu_clock_throttle_seconds_total", "counter", "uuid,reason",
       "Time the clocks were held below their target since the driver loaded, by reason (NVML perf policy: power, "
       "thermal, sync_boost, board_limit, low_utilization, reliability; totals: total_app_clocks, total_base_clocks)"),
    _m("gpu_sm_active_ratio", "gauge", U, "GPM: share of SM cycles with a warp resident, 0..1"),
    _m("gpu_sm_occupancy_ratio", "gauge", U, "GPM: warp occupancy of the SMs, 0..1"),
    _m("gpu_tensor_active_ratio", "gauge", U, "GPM: share of cycles the tensor pipes were active, 0..1"),
    _m("gpu_dram_active_ratio", "gauge", U, "GPM: share of cycles the memory interface was active, 0..1"),
    _m("gpu_ecc_errors_total", "counter", "uuid,type",
       "ECC errors since the driver loaded, type=correctable|uncorrectable"),
    _m("gpu_retired_pages_total", "counter", U, "Retired memory pages"),
    _m("gpu_remapped_rows_total", "counter", "uuid,type", "Remapped memory rows, type=correctable|uncorrectable"),
    _m("gpu_row_remap_pending", "gauge", U, "1 when a row remap waits for a GPU reset"),
    _m("gpu_row_remap_failure", "gauge", U, "1 when a row remap failed (no spare rows)"),
    _m("gpu_pcie_replay_total", "counter", U, "PCIe replay counter"),
    _m("gpu_recovery_action", "gauge", U,
       "Recovery action the driver asks for: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset"),
    _m("gpu_read_errors_total", "counter", "uuid,reason", "Cycles in which the device could not be read, by reason"),
    _m("gpu_process_memory_used_bytes", "gauge", "uuid,namespace,pod",
       "Device memory used by a pod's processes (per-process attribution, needs --per-process)"),
    # health
    _m("gpu_healthy", "gauge", U, "1 healthy, 0 not (a fatal or degraded condition is active; reading_stuck excepted)"),
    _m("gpu_health_condition", "gauge", "uuid,tier,reason",
       "1 while a condition is active, tier=fatal|degraded|informational"),
    _m("gpu_xid_errors_total", "counter", "uuid,xid", "XID events received"),
    _m("dra_device_reported_health", "gauge", "driver,pool,device,uuid,health",
       "1 per DRA device a pod of this node holds, with the health the kubelet reports for it in the pod's status "
       "(KEP-4680, from the driver), health=Healthy|Unhealthy|Unknown; never an input to gpu_healthy "
       "(needs --kubelet-device-health)"),
    # attribution
    _m("dra_device_allocation_info", "gauge", "driver,pool,device,uuid,namespace,pod,container,claim",
       "The join table: one series per device held by a container; claim empty for device-plugin allocations (driver "
       "is then the resource name)"),
    _m("dra_claim_devices", "gauge", "namespace,claim",
       "GPUs and GPU partitions allocated to the claim on this node (claims without a GPU are not exported)"),
    _m("dra_claim_pods", "gauge", "namespace,claim", "Pods on this node that hold the claim"),
    _m("dra_claim_utilization_ratio", "gauge", "namespace,claim",
       "Mean utilization over the claim's devices, once per claim"),
    _m("dra_claim_memory_used_bytes", "gauge", "namespace,claim",
       "Memory used, summed over the claim's memory pools (devices sharing one pool, such as an AMD GPU's NPS1 "
       "partitions, count it once)"),
    _m("dra_claim_memory_total_bytes", "gauge", "namespace,claim",
       "Memory size, summed over the claim's memory pools (devices sharing one pool, such as an AMD GPU's NPS1 "
       "partitions, count it once)"),
    _m("dra_claim_power_watts", "gauge", "namespace,claim",
       "Power summed over the claim's full GPUs (MIG instances have no power of their own)"),
    _m("dra_claim_healthy", "gauge", "namespace,claim", "0 if any device of the claim is unhealthy"),
    # billing (exporter/model/usage.py; docs/billing.md)
    _m("dra_claim_energy_joules_total", "counter", "namespace,claim",
       "Energy of the claim's share of its devices, integrated from the GPUs' energy counters (MIG: compute-slice "
       "part of the GPU; AMD partitions: 1/N)"),
    _m("dra_claim_device_seconds_total", "counter", "namespace,claim",
       "Allocated device-time: seconds the claim held its devices, each weighted by its part of a physical GPU and "
       "split with other claims on the same device by consumed capacity where their allocations state it, else "
       "equally"),
    _m("dra_pod_energy_joules_total", "counter", "namespace,pod",
       "Energy of the pod's share of the devices it holds (through claims or the device plugin)"),
    _m("dra_pod_device_seconds_total", "counter", "namespace,pod",
       "Allocated device-time of the pod: its claims' device-seconds split equally between their pods, plus its "
       "device-plugin devices"),
    _m("dra_pod_device_share_ratio", "gauge", "uuid,namespace,pod,rule",
       "The pod's share of a device's usage, memory and energy, 0..1 (a device's shares add up to 1); "
       "rule=per_process (by its processes' memory, --per-process), capacity (by the capacity each claim's "
       "allocation consumed of a device several claims share, KEP-5075, then equally between its pods) or equal "
       "(equally between the device's claims, then their pods)"),
    _m("dra_unresolved_devices", "gauge", "driver",
       "Allocated devices that could not be resolved to a local device; 0 for every driver of this node's "
       "ResourceSlices when all resolve"),
    _m("dra_unpublished_devices", "gauge", "driver",
       "Physical GPUs the device library sees that no ResourceSlice of this node publishes for the driver (nothing "
       "of the GPU published: not the GPU, no MIG device or partition of it); the scheduler cannot allocate them"),
    _m("dra_pod_labels", "gauge", "namespace,pod,labels",
       "Allow-listed pod labels (--pod-label-allowlist), as label_<key> labels"),
    # remediation
    _m("dra_device_taint_rule", "gauge", "driver,pool,device,effect,tier", "1 per DeviceTaintRule this agent owns"),
    _m("dra_device_taint_info", "gauge", "driver,pool,device,uuid,key,value,effect,source",
       "1 per taint on a device of this node, from every source this agent reads: the driver's ResourceSlice "
       "(source: the driver) and this agent's own DeviceTaintRules (source: dra-gpu-exporter)"),
    _m("dra_taint_pods_pending_eviction", "gauge", "rule,driver,pool,device",
       "Pods on this node still holding the device of a NoExecute DeviceTaintRule this agent owns (rule: its name), "
       "from the kubelet's PodResources; 0 once they have gone"),
    _m("dra_gpu_exporter_taint_actions_total", "counter", "action",
       "Remediation actions: create, adopt, update (effect changed), refresh (reason, evidence or sticky mark "
       "changed), delete, dry_run"),
    # The reasons come from the enum the remediator counts with, so none can go undocumented.
    _m("dra_gpu_exporter_taint_suppressed_total", "counter", "reason",
       f"Taints not applied with their full effect, or not written, by reason ({suppression_reasons()})"),
    _m("dra_gpu_exporter_taint_budget_exhausted", "gauge", "", "1 while the cluster-wide NoExecute budget is used up"),
    _m("dra_gpu_exporter_taint_writes_refused", "gauge", "",
       "DeviceTaintRule writes the API server is refusing now (401, 403, 422: RBAC, admission policy, validation); "
       "each leaves a fault untainted"),
    _m("dra_gpu_exporter_remediation_active", "gauge", "mode",
       "1 while a fault on this node gets a DeviceTaintRule (mode shadow or enforce, the DeviceTaintRule API served, "
       "the kill switch off), else 0"),
    _m("dra_gpu_exporter_detection_to_taint_seconds", "histogram", "",
       "Time from the first evidence of a fault to its DeviceTaintRule being written"),
    # self
    _m("dra_gpu_exporter_build_info", "gauge", "version", "Build information"),
    _m("dra_gpu_exporter_collector_duration_seconds", "gauge", "collector", "Duration of the collector's last run"),
    _m("dra_gpu_exporter_collector_success", "gauge", "collector", "1 if the collector's last run succeeded"),
    # each source's own requests (exporter.collect.SourceStats), since the agent started
    _m("dra_gpu_exporter_source_requests_total", "counter", "source,verb",
       "Requests a source made to its peer, by verb: list (a paginated list counts once), get, watch (kubelet: "
       "PodResources List calls, a call refused during a rate-limit backoff included)"),
    _m("dra_gpu_exporter_source_errors_total", "counter", "source",
       "A source's failed requests and broken watch streams"),
    _m("dra_gpu_exporter_source_malformed_total", "counter", "source",
       "Objects or watch events a source could not parse and skipped"),
    _m("dra_gpu_exporter_source_relists_total", "counter", "source",
       "Lists a watching source made after its first (410 Gone, recovery after an error)"),
    _m("dra_gpu_exporter_source_watch_restarts_total", "counter", "source",
       "Watches a watching source opened after its first (the server ended one, or it broke)"),
    _m("dra_gpu_exporter_last_collection_timestamp_seconds", "gauge", "", "When the last collection cycle finished"),
    _m("dra_gpu_exporter_cycles_total", "counter", "", "Collection cycles run"),
    _m("dra_gpu_exporter_starved", "gauge", "",
       "1 while the agent itself is starved of CPU (scheduling lag, cgroup throttling, device calls that never "
       "started): its late device reads are not held against the GPUs"),
    _m("dra_gpu_exporter_scheduling_lag_seconds", "gauge", "",
       "Worst lateness of the agent's own threads (scheduling-lag probe, sampler) over the starvation window"),
    # the HTTP server's own bounds (updated once per cycle)
    _m("dra_gpu_exporter_http_connections_open", "gauge", "", "HTTP connections open now"),
    _m("dra_gpu_exporter_http_connection_limit", "gauge", "",
       "Most HTTP connections held open at once (kept below the open-file limit)"),
    _m("dra_gpu_exporter_http_connections_rejected_total", "counter", "reason",
       "HTTP connections closed by the server without a request served: refused (at the limit, nothing sent while "
       "connections queue), evicted (idle, made room for a new one), tls_failed (handshake failed, or a client "
       "certificate without an allowed SAN)"),
    _m("dra_gpu_exporter_http_timeouts_total", "counter", "phase",
       "HTTP connections cut off for being slow: idle (no request), header (request head not complete), write "
       "(response not read), tls_handshake"),
    _m("dra_gpu_exporter_http_requests_total", "counter", "code", "HTTP requests answered, by status code"),
)

BY_NAME = {m.name: m for m in CATALOG}
