"""The settings every rank of one cluster shares, parsed once from the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from .fencing import FencePolicy


@dataclass(frozen=True)
class ServeConfig:
    # model and pool
    model: str = "replay"  # "replay" or "llama" (random weights)
    layers: int = 1
    kv_heads: int = 2
    q_heads: int = 2
    head_dim: int = 32
    page_size: int = 16
    prefill_page_size: int | None = None  # prefill ranks' pages (None: page_size)
    kv_layout: str = "HND"  # how a decode rank's page lies in memory: HND or NHD
    prefill_kv_layout: str | None = None  # the prefill ranks' (None: kv_layout)
    dtype: str = "fp32"
    pool_tokens: int = 65536  # per rank, before measuring what was really allocated
    context_length: int = 32768
    lower_context_length: bool = False  # operator accepts a context shorter than declared
    prefill_chunk_tokens: int | None = None  # replay model: tokens a prefill step writes
    # protocol
    tp: int = 1
    decode_tp: int = 1  # decode ranks per decode group, each holding its share of the heads
    kv_replicated: bool = False  # MLA-style: every TP member on both sides holds every head
    prefill: int | None = None
    transports: str | None = None  # UCX transports: "shm", "tcp" or None for UCX's choice
    request_timeout_s: float = 60.0  # front door deadline for one request
    transfer_timeout_s: float = 10.0  # decode waits this long for every writer's notice
    # The owner waits this long for ABORT_ACKs, then severs. 5 s: past the tcp transport's
    # failure horizon (TCP_USER_TIMEOUT 4 s with 1 s keep-alives, set by the transfer
    # engine), so a writer that is still connected has either acked or been declared dead
    # by its transport; write batches are bounded so one lands well inside it.
    abort_deadline_s: float = 5.0
    admission_wait_s: float = 5.0  # a request waits this long for pages, then 503
    integrity: bool = True  # checksums and canaries on every transferred page
    unsafe_free_on_abort: bool = False  # DANGEROUS: frees pages at abort, no quarantine
    unsafe_release_on_sever: bool = False  # DANGEROUS: releases at the deadline once severed
    # front door
    host: str = "127.0.0.1"
    port: int = 8000
    # trust and network (see cluster/trust.py and README, "Threat model")
    secret_file: str | None = None  # the cluster secret's file (else KVFERRY_SECRET[_FILE])
    api_key: str | None = field(default=None, repr=False)  # the front door's key
    api_key_file: str | None = None
    open_metrics: bool = False  # /metrics, /status, /capacity answer without the key
    cluster_interface: str | None = None  # UCX_NET_DEVICES of every rank
    fault: list[str] = field(default_factory=list)  # fault hooks, e.g. "corrupt-page:rid-marker"
    # failure domains: each job (router, a prefill group, a decode rank) its own torchrun
    store: str | None = None  # the rendezvous store: HOST:PORT (a TCPStore) or etcd://...
    store_ca: str | None = None  # etcd: TLS, the members' CA
    store_cert: str | None = None  # etcd: TLS, this client's certificate and key
    store_key: str | None = None
    store_user: str | None = None  # etcd: authentication, a user and its password's file
    store_password_file: str | None = None
    world: int | None = None  # ranks in the whole cluster (torchrun's world is one job's)
    fence_severed: FencePolicy = FencePolicy.RESTART  # see .fencing
    first_rank: int = 0  # the cluster rank of this job's first process


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1, refused with the value otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0 and finite, got {text}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    m = parser.add_argument_group("model and pool")
    m.add_argument(
        "--model",
        choices=["replay", "llama"],
        default=d.model,
        help="replay: answers replay the prompt, so a leak is readable; "
        "llama: small random-weight model for realistic shapes (default %(default)s)",
    )
    m.add_argument("--layers", type=positive_int, default=d.layers)
    m.add_argument("--kv-heads", type=positive_int, default=d.kv_heads)
    m.add_argument("--q-heads", type=positive_int, default=d.q_heads)
    m.add_argument("--head-dim", type=positive_int, default=d.head_dim)
    m.add_argument(
        "--page-size",
        type=positive_int,
        default=d.page_size,
        help="tokens per page, 1 or more (default %(default)s)",
    )
    m.add_argument(
        "--prefill-page-size",
        type=positive_int,
        default=None,
        help="tokens per page of the prefill ranks' pools, when they differ from the decode "
        "ranks' (--page-size): each writer then writes its heads' bytes into the decode "
        "pages as runs, checksummed per destination page (default: --page-size)",
    )
    m.add_argument(
        "--kv-layout",
        choices=["HND", "NHD"],
        default=d.kv_layout,
        help="how the decode ranks' pages lie in memory: HND heads-major "
        "[layers, 2, heads, page_size, head_dim], NHD token-major [layers, 2, page_size, "
        "heads, head_dim] (default %(default)s)",
    )
    m.add_argument(
        "--prefill-kv-layout",
        choices=["HND", "NHD"],
        default=None,
        help="the prefill ranks' page layout, when it differs from the decode ranks' "
        "(--kv-layout). At one page size pages go as they lie in the writer's memory and "
        "the owner turns them into its layout after its checks (about as fast as one "
        "layout); across page sizes a writer writes its heads as runs planned once per "
        "request, checksummed per destination page, in one part (default: --kv-layout)",
    )
    m.add_argument(
        "--dtype",
        choices=["fp32", "fp16", "bf16"],
        default=d.dtype,
        help="KV pool dtype (default %(default)s)",
    )
    m.add_argument(
        "--pool-tokens",
        type=positive_int,
        default=d.pool_tokens,
        help="tokens of KV pool per rank (default %(default)s)",
    )
    m.add_argument(
        "--context-length",
        type=positive_int,
        default=d.context_length,
        help="longest prompt + output served, 1 or more (default %(default)s)",
    )
    m.add_argument(
        "--prefill-chunk-tokens",
        type=positive_int,
        default=d.prefill_chunk_tokens,
        metavar="N",
        help="replay model: tokens a prefill step writes; a prompt longer than this sends "
        "its KV in parts as they become final, each checked by the owner when it lands "
        "(default: the model's, 65536; the llama model writes a layer whole and refuses it)",
    )
    m.add_argument(
        "--lower-context-length",
        action="store_true",
        help="start even if the measured pool is below --context-length, serving "
        "the measured capacity instead (logged)",
    )
    p = parser.add_argument_group("roles and protocol")
    p.add_argument(
        "--prefill",
        type=positive_int,
        default=None,
        help="number of prefill ranks (default: about half of the non-router ranks)",
    )
    p.add_argument(
        "--tp", type=positive_int, default=d.tp, help="tensor-parallel size of a prefill group"
    )
    p.add_argument(
        "--decode-tp",
        type=positive_int,
        default=d.decode_tp,
        help="tensor-parallel size of a decode group: each member holds its share of the KV "
        "heads in a pool of its own (with more members than heads, members share a head) "
        "and owns its pages; any --tp writes into any --decode-tp. With --model llama the "
        "group steps together: its first member runs the model and asks the others for "
        "their heads' attention at each layer (default %(default)s)",
    )
    p.add_argument(
        "--kv-replicated",
        action="store_true",
        help="MLA-style KV, replicated across tensor parallelism: every member of a prefill "
        "or decode group holds every KV head; each decode member takes the whole KV from one "
        "prefill member (the others write nothing into it and it waits for none of them), "
        "and decodes alone, with any model",
    )
    p.add_argument(
        "--transports",
        choices=["shm", "tcp", "rdma"],
        default=None,
        help="UCX transports for page writes: shm, tcp, or rdma (rc/ud/dc over verbs; "
        "needs a UCX built with verbs and an RDMA device) (default: UCX's choice)",
    )
    p.add_argument(
        "--request-timeout",
        dest="request_timeout_s",
        type=positive_float,
        default=d.request_timeout_s,
        help="seconds (default %(default)s)",
    )
    p.add_argument(
        "--transfer-timeout",
        dest="transfer_timeout_s",
        type=positive_float,
        default=d.transfer_timeout_s,
        help="seconds a decode rank waits for every writer's notice, per 65,536 "
        "prompt tokens (default %(default)s)",
    )
    p.add_argument(
        "--abort-deadline",
        dest="abort_deadline_s",
        type=positive_float,
        default=d.abort_deadline_s,
        help="seconds an owner waits for abort acks before severing (default %(default)s)",
    )
    p.add_argument(
        "--admission-wait",
        dest="admission_wait_s",
        type=positive_float,
        default=d.admission_wait_s,
        help="seconds (default %(default)s)",
    )
    p.add_argument(
        "--no-integrity",
        dest="integrity",
        action="store_false",
        help="skip page checksums and canaries",
    )
    p.add_argument(
        "--unsafe-free-on-abort",
        action="store_true",
        help="DANGEROUS, for tests only: free pages at abort without quarantine "
        "and skip integrity checks",
    )
    p.add_argument(
        "--unsafe-release-on-sever",
        action="store_true",
        help="DANGEROUS, for tests only: at the abort deadline release quarantined "
        "pages once the silent writers are severed, without proof that their "
        "writes stopped",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        help="enable a fault hook (tests only), e.g. corrupt-page:MARKER",
    )
    g = parser.add_argument_group(
        "failure domains",
        "run each job (the router, a prefill group, a decode rank) as its own torchrun job "
        "meeting through a rendezvous store: a rank's death then costs its own requests, "
        "and a restarted rank rejoins with a new incarnation",
    )
    g.add_argument(
        "--store",
        default=None,
        metavar="HOST:PORT|etcd://HOST:PORT,...[/PREFIX]",
        help="the cluster's rendezvous store: a TCPStore (python -m kvferry.cluster.store) or "
        "an etcd cluster (3.4+; every key under PREFIX/, default kvferry: one prefix per "
        "cluster); without it every rank is one torchrun group that stops as a whole",
    )
    g.add_argument(
        "--store-ca", default=None, metavar="FILE", help="etcd over TLS: the members' CA"
    )
    g.add_argument(
        "--store-cert",
        default=None,
        metavar="FILE",
        help="etcd over TLS: this client's certificate (for --client-cert-auth; no "
        "CommonName: etcd's JSON gateway refuses one that has it)",
    )
    g.add_argument(
        "--store-key", default=None, metavar="FILE", help="etcd over TLS: that certificate's key"
    )
    g.add_argument(
        "--store-user", default=None, metavar="NAME", help="etcd authentication: the user"
    )
    g.add_argument(
        "--store-password-file",
        default=None,
        metavar="FILE",
        help="etcd authentication: the user's password, the file's first line",
    )
    g.add_argument(
        "--fence-severed",
        type=FencePolicy,
        choices=list(FencePolicy),
        default=d.fence_severed,
        help="what becomes of a rank an owner severed (no ack within the abort deadline): "
        "'restart' (default) has its launcher kill it, which proves its writes stopped, "
        "and torchrun restart it as a new incarnation, admitted once the old one's "
        "quarantines are released; 'off' leaves it severed, out of service until the "
        "cluster is stopped",
    )
    g.add_argument(
        "--world",
        type=positive_int,
        default=None,
        help="ranks in the whole cluster (with --store)",
    )
    g.add_argument(
        "--first-rank",
        type=int,
        default=0,
        help="cluster rank of this job's first process (with --store; default 0)",
    )
    f = parser.add_argument_group("front door")
    f.add_argument(
        "--host",
        default=d.host,
        help="address the front door listens on, and only there (default %(default)s)",
    )
    f.add_argument("--port", type=int, default=d.port, help="front door port (default %(default)s)")
    f.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (401 "
        "otherwise); a key on the command line shows in ps: prefer --api-key-file or "
        "KVFERRY_API_KEY",
    )
    f.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="as --api-key, the key read from FILE",
    )
    f.add_argument(
        "--open-metrics",
        action="store_true",
        help="with an API key, leave /metrics, /status and /capacity open (for scrapers "
        "without the key)",
    )
    t = parser.add_argument_group(
        "trust and network",
        "every rank of a cluster holds one secret: control messages, rank cards and exit "
        "records are authenticated with it, and the cards' addresses and memory keys "
        "encrypted (README, 'Threat model')",
    )
    t.add_argument(
        "--secret-file",
        default=None,
        metavar="FILE",
        help="the cluster secret, the same file on every node (`kvferry secret > FILE` "
        "makes one); else KVFERRY_SECRET_FILE, else KVFERRY_SECRET (the secret itself). A "
        "rank without one refuses to start; serve-local.sh and `kvferry serve --nproc` "
        "make one for a cluster on one host",
    )
    t.add_argument(
        "--cluster-interface",
        default=None,
        metavar="DEVICES",
        help="the cluster network's devices, set as UCX_NET_DEVICES for every rank: an "
        "interface for tcp (eth1), an HCA port for rdma (mlx5_0:1), or both, comma-separated; "
        "UCX then uses and listens on those only (default: UCX_NET_DEVICES as set, else all)",
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    names = ServeConfig.__dataclass_fields__.keys()
    return ServeConfig(**{k: getattr(args, k) for k in names if hasattr(args, k)})
