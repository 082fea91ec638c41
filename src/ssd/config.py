"""EngineConfig: which models, which mode, where they run."""
from __future__ import annotations

import logging
from dataclasses import dataclass

MODES = ("ar", "sd", "ssd", "auto")

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model: str = "qwen2.5-coder-1.5b"
    draft: str | None = None
    mode: str | None = None              # None: "auto" when a draft is given, else "ar"
    k: int = 4                           # draft tokens per speculation round
    device: str = "cpu"
    draft_device: str | None = None      # default: same as device
    threads: int | None = None           # CPU threads for torch (None: leave torch's default)
    prefill_threads: int | None = None   # CPU threads for prefill steps (default: threads). With SSD on a
                                         # CPU the draft worker's core is idle while the target
                                         # prefills: equal-hardware setups give prefill all cores.
    dtype: str = "auto"                  # auto | gguf | q8_0 | q4_1 | float32 | bfloat16 | float16 | int8 (CPU)
    draft_dtype: str | None = None       # default: same as dtype. The draft's numerics never change what
                                         # the target emits, so a faster int8 draft stays exact.
    draft_vocab: int = 0                 # N > 0: the draft scores only the N most frequent token ids, the special
                                         # tokens and every token it was fed (layers/reduced_head.py); exact
                                         # either way. 0: the whole vocabulary (measured no faster here, README)
    max_model_len: int = 4096
    kv_cache_gb: float = 1.0             # KV memory of the target; the draft gets the same number of slots
    kv_cache_tokens: int | None = None   # KV slots of the target in tokens (llama.cpp's context size);
                                         # replaces kv_cache_gb when set
    block_size: int = 16
    max_num_seqs: int = 16
    spec_max_batch: int | None = None    # sd/ssd: draft only while the decode batch has at most this many
                                         # sequences; larger batches decode autoregressively (exact either way)
    max_num_batched_tokens: int = 4096
    progress: bool = True
    trace: bool = False                  # record target/draft spans (LLM.write_trace, CLI --trace)
    # SSD: the draft worker process
    draft_threads: int | None = None     # threads of the draft worker (default 1 on CPU)
    num_draft_workers: int | None = None # data-parallel drafts: workers sharing the batch (default: one per
                                         # draft_host address, else 1); see speculation/worker/placement.py
    draft_cores: list[int] | list[list[int]] | None = None  # CPU cores to pin the worker to (default: the last
                                         # core; M workers: the last M cores); one list per worker when M > 1
    draft_host: str | list[str] | None = None  # "HOST:PORT" (or one per worker: a list, or comma-separated): wait
                                         # for `ssd draft-worker --connect` there instead of spawning
    fanout_budget: int | None = None     # chains pre-drafted per sequence per round (None: sized online)
    saguaro_c: float = 1.0               # Saguaro sampling: weight of the cached top-F tokens in q' (1 = plain q)
    backup: str = "auto"                 # miss backup: auto (by batch size, measured) | neural | fast
    worker_timeout_s: float = 60.0       # bound on every engine/worker message once the worker is up
    worker_start_timeout_s: float = 300.0  # bound on a worker's start-up: process start or joining, loading the
                                         # draft (minutes on a busy machine or for a big draft)
    auto_ssd: bool | None = None         # mode auto: also run draft workers and let auto choose SSD stints
                                         # (the target takes the workers' cores back in the other rounds).
                                         # None: on where the settings ask for workers (worker_settings)
    # tensor-parallel target (CPU ranks over gloo; ssd/distributed, docs/ARCHITECTURE.md)
    tensor_parallel_size: int = 1        # ranks the target is sharded over; rank 0 is this process
    tp_host: str | None = None           # "HOST:PORT": wait for `ssd tp-rank --connect` there instead of spawning
    tp_timeout_s: float = 60.0           # bound on start-up and on every collective of a step
    tp_transport: str = "auto"           # collectives: "auto" = shared memory between ranks on one host,
                                         # gloo otherwise; "gloo" = always gloo (TCP)

    def __post_init__(self) -> None:
        if self.mode is None:
            self.mode = "auto" if self.draft else "ar"
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.mode != "ar" and not self.draft:
            from ssd.models.registry import default_draft

            self.draft = default_draft(self.model)      # a built-in target knows its built-in draft
            if not self.draft:
                raise ValueError(f"mode {self.mode!r} needs a draft model and {self.model!r} has no built-in "
                                 "draft partner: pass draft=... (CLI: --draft), e.g. qwen2.5-coder-0.5b")
        self._resolve_auto_ssd()
        if not isinstance(self.draft_vocab, int) or isinstance(self.draft_vocab, bool) or self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be an integer >= 0 (0 = the draft scores the whole vocabulary), "
                             f"got {self.draft_vocab!r}")
        if self.k < 1 or self.k > 16:
            raise ValueError(f"k must be in [1, 16], got {self.k}")
        if self.block_size < 1 or self.max_model_len < 2 or self.kv_cache_gb <= 0:
            raise ValueError("block_size >= 1, max_model_len >= 2 and kv_cache_gb > 0 are required")
        if self.kv_cache_tokens is not None and (not isinstance(self.kv_cache_tokens, int)
                                                 or isinstance(self.kv_cache_tokens, bool) or self.kv_cache_tokens < 1):
            raise ValueError(f"kv_cache_tokens must be a whole number of tokens >= 1 (or None: size the cache by "
                             f"kv_cache_gb), got {self.kv_cache_tokens!r}")
        if self.backup not in ("auto", "neural", "fast"):
            raise ValueError(f"backup must be 'auto', 'neural' or 'fast', got {self.backup!r}")
        if self.fanout_budget is not None and self.fanout_budget < 1:
            raise ValueError(f"fanout_budget must be >= 1 chains per sequence, or None to size it from measured "
                             f"timings; got {self.fanout_budget}")
        if not 0.0 <= self.saguaro_c <= 1.0:
            raise ValueError(f"saguaro_c must be in [0, 1], got {self.saguaro_c}")
        for name in ("device", "draft_device"):
            check_device(name, getattr(self, name))
        if self.mode == "ssd" and self.draft_host is not None and self.draft_device is not None:
            raise ValueError("draft_device applies to a local SSD worker; a remote worker (draft_host) picks its "
                             "device itself (`ssd draft-worker --device ...`)")
        self._check_draft_workers()
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.spec_max_batch is not None and (self.spec_max_batch < 1 or self.mode == "ar"):
            raise ValueError(f"spec_max_batch must be >= 1 and applies to modes 'sd' and 'ssd' (got {self.spec_max_batch} "
                             f"with mode {self.mode!r})")
        if self.auto_ssd and self.mode != "auto":
            raise ValueError(f"auto_ssd lets mode 'auto' choose SSD rounds; it does not apply to mode {self.mode!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.tp_host is None and str(self.device).startswith("cuda"):
            import torch

            from ssd.distributed.devices import spawned_rank_devices

            spawned_rank_devices(self.device, self.tensor_parallel_size, torch.cuda.device_count())  # one GPU a rank
        if self.tp_host is not None and self.tensor_parallel_size == 1:
            raise ValueError("tp_host waits for tensor-parallel ranks; it needs tensor_parallel_size > 1")
        if self.tp_transport not in ("auto", "gloo"):
            raise ValueError(f"tp_transport must be 'auto' or 'gloo', got {self.tp_transport!r}")
        if self.tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        if self.worker_timeout_s <= 0 or self.worker_start_timeout_s <= 0:
            raise ValueError("worker_timeout_s and worker_start_timeout_s must be > 0")
        if self.prefill_threads is not None and self.prefill_threads < 1:
            raise ValueError(f"prefill_threads must be >= 1, got {self.prefill_threads}")

    def _resolve_auto_ssd(self) -> None:
        """Settings that only draft workers use turn auto_ssd on in mode auto (they were ignored before:
        `--draft-host` with the default mode ran every round in-process); modes without workers, or
        auto_ssd=False next to them, are an error instead of a silent no-op."""
        asked = worker_settings(self)
        if asked and self.mode in ("ar", "sd"):
            raise ValueError(f"{', '.join(asked)} applies to mode 'ssd' and to 'auto' (draft workers); mode "
                             f"{self.mode!r} runs no draft worker: use mode 'ssd' or 'auto', or drop {asked[0]}")
        if self.auto_ssd is None:
            self.auto_ssd = self.mode == "auto" and bool(asked)
            if self.auto_ssd:
                log.info("mode auto: %s set, so auto runs draft workers and may choose SSD stints (auto_ssd; "
                         "auto_ssd=False with none of them keeps every draft in-process)", ", ".join(asked))
        elif not self.auto_ssd and asked and self.mode == "auto":
            raise ValueError(f"auto_ssd=False keeps mode 'auto' from running draft workers, but {', '.join(asked)} "
                             "configures them: drop one or the other")

    def _check_draft_workers(self) -> None:
        from ssd.speculation.worker.placement import per_worker_cores, split_hosts

        hosts = split_hosts(self.draft_host)
        if self.num_draft_workers is None:
            self.num_draft_workers = len(hosts) if hosts else 1
        n = self.num_draft_workers
        if n < 1:
            raise ValueError(f"num_draft_workers must be >= 1, got {n}")
        workers = self.mode == "ssd" or self.mode == "auto" and self.auto_ssd
        if n > 1 and not workers:
            raise ValueError(f"num_draft_workers={n} applies to mode 'ssd' and to 'auto' with auto_ssd (draft "
                             f"workers), not {self.mode!r}")
        if hosts is not None and len(hosts) != n:
            raise ValueError(f"draft_host lists {len(hosts)} address(es) for num_draft_workers={n}: give one HOST:PORT "
                             "per worker (or leave num_draft_workers unset)")
        if workers and hosts is None:
            per_worker_cores(self.draft_cores, n)      # raises on a malformed placement


def worker_settings(cfg: EngineConfig) -> list[str]:
    """The settings given that only SSD draft workers use (mode auto: they ask for auto_ssd)."""
    asked = [name for name in ("draft_host", "draft_cores", "draft_threads") if getattr(cfg, name) is not None]
    if cfg.num_draft_workers is not None and cfg.num_draft_workers != 1:
        asked.append("num_draft_workers")
    return asked


def check_device(name: str, device: str | None) -> None:
    """'cpu' or 'cuda[:N]' that this machine has; a clear ValueError otherwise."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{name} {device!r} is not a device: use 'cpu' or 'cuda:N'") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ValueError(f"{name} {device!r}: only 'cpu' and 'cuda:N' are supported")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"{name} {device!r} was requested but CUDA is not available ({why}): use 'cpu', or "
                         "install a CUDA build of torch on a machine with a GPU")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{name} {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
