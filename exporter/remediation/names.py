"""The names this agent writes into the cluster live in :mod:`exporter.k8s.names` (the k8s layer
writes them and must not import the remediator); re-exported here for the remediator's code."""

from ..k8s.names import *  # noqa: F403
from ..k8s.names import label_value, node_state_name, rule_name  # noqa: F401
