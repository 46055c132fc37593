"""A refused DeviceTaintRule write is visible (issue 16, Deliver 4): the remediation collector
fails, /readyz's body names the refused write, and dra_gpu_exporter_taint_writes_refused (the
GPURemediationWriteRefused alert's input) counts it; all cleared once the write goes through.

The whole agent, built by the real wiring, on a simulated node against the HTTP API emulation,
which answers the agent's rule creation with 403 as RBAC or an admission policy would.
"""

from __future__ import annotations

from k8s_helpers import wait_until
from test_agent_isolation import MIXED, simulated_node, with_faults

from exporter.config import TaintMode


def test_a_403_on_rule_creation_turns_the_collector_and_readyz_red_until_it_succeeds():
    sc = with_faults(MIXED, {"kind": "lost", "gpu": "gpu1"})  # fatal from the first cycle

    def deny(api):
        api.fail_next("POST", r"/devicetaintrules$", 403, count=1, message='devicetaintrules is forbidden: User "system:serviceaccount:x:y" cannot create')

    with simulated_node(sc, taint_mode=TaintMode.ENFORCE, api_setup=deny) as n:
        def refused():
            m = n.scrape()
            return m.value("dra_gpu_exporter_collector_success", collector="remediation") == 0 and m.value("dra_gpu_exporter_taint_writes_refused") == 1 and m

        wait_until(refused, timeout=15, interval=0.05, message="the refused write in the metrics")
        status, body = n.readyz()
        assert status == 200 and body.startswith("ready (degraded)")  # device metrics still worth scraping
        assert "remediation: DeviceTaintRule writes refused" in body and "(403)" in body and "forbidden" in body
        assert n.api.list("resource.k8s.io", "devicetaintrules") == []
        # the server accepts it again: the held write is retried when the decision changes
        # (fence -> evict after the settle window) and everything turns green
        n.agent.out.remediation.refusals.clear()  # (skip the 5-minute hold: what is under test is the report)
        n.agent.out.remediation.poke()

        def written():
            # the rule stored first: clearing the hold turns the report green at once, before
            # the remediation thread has made the write (on a busy machine, a scrape earlier)
            if not n.api.list("resource.k8s.io", "devicetaintrules"):
                return False
            m = n.scrape()
            return m.value("dra_gpu_exporter_collector_success", collector="remediation") == 1 and m.value("dra_gpu_exporter_taint_writes_refused") == 0 and m

        wait_until(written, timeout=15, interval=0.05, message="the write going through")
        assert "remediation" not in n.readyz()[1]
