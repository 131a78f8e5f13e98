"""colossal.comm: launch, the N-D process-group mesh, collectives with events, test harness.

Every other Colossal package communicates through these names only.
"""

from colossal.comm.arrival import (
    DEFAULT_ARRIVAL_TIMEOUT,
    ArrivalError,
    check_arrival,
    monitored,
    monitored_call,
    resolve_arrival_timeout,
)
from colossal.comm.collectives import (
    CommHandle,
    P2POp,
    all_gather,
    all_gather_list,
    all_reduce,
    all_to_all,
    all_to_all_dims,
    batch_p2p,
    broadcast,
    group_ranks,
    recv,
    reduce,
    reduce_scatter,
    ring_exchange,
    send,
)
from colossal.comm.debug import CollectiveMismatchError, debug_enabled, set_debug
from colossal.comm.events import (
    CommCounter,
    CommEvent,
    ObserverHandle,
    ObserverRegistry,
    bus_factor,
    has_observers,
    register_observer,
)
from colossal.comm.functional import (
    all_gather_along_dim,
    all_to_all_along_dims,
    copy_to_group,
    gather_along_dim,
    reduce_from_group,
    reduce_scatter_along_dim,
    split_along_dim,
)
from colossal.comm.hooks import weak_hook
from colossal.comm.knobs import PRECISIONS, as_bytes, as_count, as_dtype, as_fraction
from colossal.comm.launch import (
    LaunchInfo,
    default_backend,
    default_device,
    detect_launcher,
    ensure_process_group,
    launch,
)
from colossal.comm.layouts import Layout2D, Layout2p5D, Layout3D
from colossal.comm.mesh import Axis, Mesh
from colossal.comm.meta import is_unset, mark_unset, unset_mark, unset_names
from colossal.comm.packing import pack, plan_depths, search_chunk_size, upcoming_chunks

__all__ = [
    "pack",
    "search_chunk_size",
    "plan_depths",
    "upcoming_chunks",
    "ensure_process_group",
    "PRECISIONS",
    "as_bytes",
    "as_count",
    "as_dtype",
    "as_fraction",
    "weak_hook",
    "is_unset",
    "mark_unset",
    "unset_mark",
    "unset_names",
    "ArrivalError",
    "DEFAULT_ARRIVAL_TIMEOUT",
    "check_arrival",
    "monitored",
    "monitored_call",
    "resolve_arrival_timeout",
    "Axis",
    "CollectiveMismatchError",
    "CommCounter",
    "CommEvent",
    "CommHandle",
    "LaunchInfo",
    "Layout2D",
    "Layout2p5D",
    "Layout3D",
    "Mesh",
    "ObserverHandle",
    "ObserverRegistry",
    "P2POp",
    "all_gather",
    "all_gather_along_dim",
    "all_gather_list",
    "all_reduce",
    "all_to_all",
    "all_to_all_along_dims",
    "all_to_all_dims",
    "batch_p2p",
    "broadcast",
    "bus_factor",
    "copy_to_group",
    "debug_enabled",
    "default_backend",
    "default_device",
    "detect_launcher",
    "gather_along_dim",
    "group_ranks",
    "has_observers",
    "launch",
    "recv",
    "reduce",
    "reduce_from_group",
    "reduce_scatter",
    "reduce_scatter_along_dim",
    "register_observer",
    "ring_exchange",
    "send",
    "set_debug",
    "split_along_dim",
]
