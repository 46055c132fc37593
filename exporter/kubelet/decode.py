"""The kubelet's List answer decoded within bounds no real node reaches, and within a deadline.

An answer may be up to 16 MiB (the transport's limit), and protobuf's parser (upb, in C)
decodes all of it at once: 8 million empty pods cost ~600 MiB before any of our code runs,
2 million device ids ~80 MiB (and as many rows again in the conversion), 16 million packed
CPU ids ~240 MiB. A wedged or hostile kubelet, or anything that can bind the socket path,
would take the agent past its memory limit. So before protobuf decodes anything, a census
walks the answer's wire format (a field's tag says its number and how long it is) down the
fields the conversion reads, counts what decoding would make, and refuses an answer over
the bounds as soon as a count passes one:

=========================  ==========  ====================================================
bound                      value       a real node
=========================  ==========  ====================================================
pods                       10,000      kubelet --max-pods: 110 by default; large nodes
                                       ~250-1,000
allocation rows            100,000     (container, device) pairs: device-plugin ids and DRA
                                       claim devices. A node has 8-16 GPUs (up to 7 MIG
                                       instances each); shared claims list a device per
                                       container: a few thousand at most
decoded items              200,000     pods, containers, device lists, ids, claims, claim
                                       devices: ~3-10 per pod
CPU ids                    100,000     exclusive CPUs, disjoint across containers since
                                       kubelet 1.23 (kubernetes#97415): at most the node's
                                       CPUs, a few hundred to ~2,000
fields read by the census  1,000,000   ~20-70 per pod (CDI names accumulate per driver);
                                       bounds the census's own time (~0.3 s on the bench VM)
=========================  ==========  ====================================================

The worst answers within these bounds (100,000 rows of 150-byte ids, 100,000 device lists
with 130-byte names) decode and convert in ~40 MiB above the 16 MiB answer itself.

Then protobuf decodes the answer into a *view* of the API: the same messages with only the
fields the conversion reads. Everything else (CPU ids, memory, NUMA topology, CDI names) is
kept by protobuf as unknown bytes, never expanded into objects (16 M CPU ids would stay ~16 MB,
where the full messages make ~240 MiB of them), so those need no bound of their own but the
answer's size; CPU ids are counted all the same, no node has millions.
The view is derived from the generated API descriptor at import, so field numbers and names
cannot drift from api.proto.

The census, the decode and the conversion run under the deadline the caller gives (what is
left of the call's); the census and the conversion look at the clock as they go.
"""

from __future__ import annotations

import time
from typing import NoReturn, cast

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from exporter.kubelet import api_pb2
from exporter.kubelet.convert import DeadlinePassed, to_snapshot
from exporter.kubelet.model import PodResourcesSnapshot

MAX_PODS = 10_000
MAX_ROWS = 100_000
MAX_ITEMS = 200_000
MAX_CPU_IDS = 100_000
MAX_FIELDS = 1_000_000


class AnswerRefused(Exception):
    """The answer is over a bound (or, as AnswerMalformed, no ListPodResourcesResponse at all)."""


class AnswerMalformed(AnswerRefused):
    """The answer is no ListPodResourcesResponse: a broken wire format, invalid UTF-8."""


# The fields the conversion reads, by message: the view keeps these and no others.
_READ = {
    "ListPodResourcesResponse": ("pod_resources",),
    "PodResources": ("name", "namespace", "containers"),
    "ContainerResources": ("name", "devices", "dynamic_resources"),
    "ContainerDevices": ("resource_name", "device_ids"),
    "DynamicResource": ("claim_name", "claim_namespace", "claim_resources"),
    "ClaimResource": ("driver_name", "pool_name", "device_name", "share_id"),
}


def _view_class() -> type[Message]:
    """ListPodResourcesResponse with only the _READ fields, built from api_pb2's descriptor."""
    file = descriptor_pb2.FileDescriptorProto()
    api_pb2.DESCRIPTOR.CopyToProto(file)
    package = file.package
    file.name, file.package = "list_view.proto", package + "view"  # a name of its own pool: no file on disk
    del file.service[:]
    kept = [m for m in file.message_type if m.name in _READ]
    del file.message_type[:]
    file.message_type.extend(kept)
    for message in file.message_type:
        fields = [f for f in message.field if f.name in _READ[message.name]]
        del message.field[:]
        message.field.extend(fields)
        for f in message.field:
            if f.type_name:  # a message type of this file: the view's own
                f.type_name = f.type_name.replace(f".{package}.", f".{package}view.", 1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{file.package}.ListPodResourcesResponse"))


_View = _view_class()

# The census's walk: per message kind, the fields (number -> kind of what they hold) it counts
# and descends into. 1 response, 2 pod, 3 container, 4 device list, 5 claim, 6 claim device
# (a row, not descended: its strings are bounded by the answer's size), 7 device id (a row),
# 8 CPU ids (packed, or one per field).
_RESPONSE, _POD, _CONTAINER, _DEVICES, _CLAIM, _CLAIM_DEVICE, _DEVICE_ID, _CPU_IDS = range(1, 9)
_CHILDREN: dict[int, dict[int, int]] = {
    _RESPONSE: {1: _POD},  # pod_resources
    _POD: {3: _CONTAINER, 4: _CPU_IDS},  # containers, cpu_ids (1.37+)
    _CONTAINER: {2: _DEVICES, 3: _CPU_IDS, 5: _CLAIM},  # devices, cpu_ids, dynamic_resources
    _DEVICES: {2: _DEVICE_ID},  # device_ids
    _CLAIM: {4: _CLAIM_DEVICE},  # claim_resources
    _CLAIM_DEVICE: {},
}
_DESCEND = frozenset((_POD, _CONTAINER, _DEVICES, _CLAIM))
_VARINT_ENDS = bytes(range(0x80))


class Census:
    """Counts of what decoding an answer would make; refuses it once a count is over its bound."""

    __slots__ = ("check_at", "cpu_ids", "data", "deadline", "fields", "items", "pods", "rows")

    def __init__(self, data: bytes | bytearray, deadline: float | None) -> None:
        self.data = data
        self.deadline = deadline
        self.fields = self.items = self.pods = self.rows = self.cpu_ids = 0
        self.check_at = min(1024, MAX_FIELDS + 1)  # the field count at which to look at the bound and the clock

    def walk(self, kind: int, pos: int, end: int) -> None:
        """Read the fields of one message (of ``kind``) in data[pos:end]."""
        data = self.data
        children = _CHILDREN[kind]
        while pos < end:
            tag = data[pos]
            pos += 1
            if tag >= 0x80:
                tag, pos = self._varint(tag, pos, end)
            self.fields += 1
            if self.fields >= self.check_at:
                self._check_progress()
            wire = tag & 7
            if wire == 2:  # length-delimited: a string, bytes, a message or a packed array
                size = data[pos] if pos < end else 0x80
                pos += 1
                if size >= 0x80:
                    size, pos = self._varint(size, pos, end)
                value_end = pos + size
                if value_end > end:
                    self._malformed("a field runs past its message")
                child = children.get(tag >> 3)
                if child == _CPU_IDS:
                    self._count_cpu_ids(pos, value_end)
                elif child is not None:
                    self._count(child)
                    if child in _DESCEND:
                        self.walk(child, pos, value_end)
                pos = value_end
            elif wire == 0:  # varint
                while True:
                    if pos >= end:
                        self._malformed("a varint runs past its message")
                    pos += 1
                    if data[pos - 1] < 0x80:
                        break
                if children.get(tag >> 3) == _CPU_IDS:  # an unpacked CPU id
                    self.cpu_ids += 1
                    if self.cpu_ids > MAX_CPU_IDS:
                        self._refuse(f"more than {MAX_CPU_IDS} CPU ids")
            elif wire == 1:  # 64 bits
                pos += 8
            elif wire == 5:  # 32 bits
                pos += 4
            else:  # groups (3, 4): proto2 only, and none in this API; 6, 7: no wire type
                self._malformed(f"wire type {wire}")
        if pos != end:
            self._malformed("a field runs past its message")

    def _count(self, child: int) -> None:
        self.items += 1
        if self.items > MAX_ITEMS:
            self._refuse(f"more than {MAX_ITEMS} decoded items (pods, containers, devices, claims)")
        if child == _POD:
            self.pods += 1
            if self.pods > MAX_PODS:
                self._refuse(f"more than {MAX_PODS} pods")
        elif child in (_DEVICE_ID, _CLAIM_DEVICE):
            self.rows += 1
            if self.rows > MAX_ROWS:
                self._refuse(f"more than {MAX_ROWS} allocated devices")

    def _count_cpu_ids(self, pos: int, end: int) -> None:
        """The varints of a packed array in data[pos:end]: one per byte under 0x80 (a varint's
        last byte), counted 64 KiB at a time in C."""
        for start in range(pos, end, 65536):
            piece = self.data[start : min(end, start + 65536)]
            self.cpu_ids += len(piece) - len(piece.translate(None, _VARINT_ENDS))
            if self.cpu_ids > MAX_CPU_IDS:
                self._refuse(f"more than {MAX_CPU_IDS} CPU ids")

    def _check_progress(self) -> None:
        if self.fields > MAX_FIELDS:
            self._refuse(f"more than {MAX_FIELDS} fields")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlinePassed
        self.check_at = min(self.fields + 1024, MAX_FIELDS + 1)

    def _varint(self, first: int, pos: int, end: int) -> tuple[int, int]:
        """The varint whose first byte (``first``, >= 0x80) came before ``pos``."""
        value, shift = first & 0x7F, 7
        while True:
            if pos >= end or shift > 63:
                self._malformed("a varint runs past its message")
            byte = self.data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos
            shift += 7

    def _refuse(self, what: str) -> NoReturn:
        raise AnswerRefused(f"{what} in one answer: over the bound for one node")

    def _malformed(self, what: str) -> NoReturn:
        raise AnswerMalformed(f"not a ListPodResourcesResponse ({what})")


def census(data: bytes | bytearray, deadline: float | None = None) -> Census:
    """What decoding the answer would make; AnswerRefused if a bound is passed or the wire
    format is broken, DeadlinePassed once ``deadline`` (time.monotonic()) is past."""
    c = Census(data, deadline)
    c.walk(_RESPONSE, 0, len(data))
    return c


def decode(data: bytes | bytearray, deadline: float | None = None) -> PodResourcesSnapshot:
    """The snapshot of a List answer: census, then protobuf's decode of the view, then the
    conversion. Raises AnswerRefused (over a bound), AnswerMalformed or DeadlinePassed."""
    census(data, deadline)
    try:
        view = _View.FromString(cast(bytes, data))  # upb reads any buffer: a bytearray is not copied
    except Exception as err:  # protobuf's DecodeError: invalid UTF-8 in a string, say
        raise AnswerMalformed(f"not a ListPodResourcesResponse ({err})") from None
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlinePassed
    # The view has every field the conversion reads, under the same names.
    return to_snapshot(cast(api_pb2.ListPodResourcesResponse, view), deadline)
