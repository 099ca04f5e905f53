"""Configuration: keyword arguments first, ``ECHONCCL_*`` environment variables override them.

| variable                  | meaning                                              | default |
|---------------------------|------------------------------------------------------|---------|
| ECHONCCL_ENGINE           | cpu, gpu or auto                                     | auto    |
| ECHONCCL_ALGO             | two_shot, ring, two_shot_pipelined, one_shot_q, nccl, one_shot or auto | auto |
| ECHONCCL_GROUP_SIZE       | elements per scale: 32, 64, 128 (int7-h32: 16)       | 32 (16) |
| ECHONCCL_CODEC            | int4-h32 (rotated), int4, or int7-h32 (8 bits; `codec`) | int4-h32 |
| ECHONCCL_CROSSOVER_BYTES  | auto: below this many input bytes use the baseline   | engine's measured value |
| ECHONCCL_TIMEOUT          | seconds before a silent peer raises PeerTimeoutError | 300     |
| ECHONCCL_ROUNDS           | 4-bit rounds per all-reduce (2+: also send residuals) | 1       |
| ECHONCCL_CACHE_BYTES      | bound on cached workspaces + default feedback states | 1 GiB   |
| ECHONCCL_FEEDBACK_ROUNDING | 0: owners feed back their quantization error only, not their 16-bit output's rounding (`Feedback`) | 1 |
| ECHONCCL_DEBUG            | INFO logs the resolved configuration once at init    | unset   |

Read where they are used: ``ECHONCCL_DEVICE`` (the GPU, default the node-local
rank; `engine_gpu`), ``ECHONCCL_NCCL_LIBRARY`` (a libnccl.so.2 path; `nccl`),
``ECHONCCL_FATBIN`` (prebuilt kernels; `kernels_cuda`), ``ECHONCCL_PIPELINE_MIN_CHUNK``
(elements per chunk of two_shot_pipelined; `schedules.pipelined`), ``ECHONCCL_FUSED``
(0: no fused peer-memory kernels, every schedule over NCCL; `fused`),
``ECHONCCL_FUSED_CROSSOVER_BYTES`` (auto with fused kernels: below it the 16-bit one-shot;
`engine_gpu`), ``ECHONCCL_FUSED_BLOCKS_PER_SM`` (grid of the fused kernels; `fused`),
``ECHONCCL_FUSED_WHOLE`` (0: the general fused kernel where the whole-slice one fits; `fused`),
``ECHONCCL_NCCL_ALLGATHER`` (0: the NCCL path's all-gathers as send/recv rounds;
`transport_nccl`), ``ECHONCCL_COMM_PRIORITY`` (1: the communication stream at the
greatest priority; `transport_nccl`), ``ECHONCCL_CODEC_MAX_BLOCKS`` (a cap on the
codec kernels' grids, leaving SMs to kernels on other streams; `kernels_cuda`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from . import codec
from .schedules import SCHEDULES

# The 4-bit schedules, the plain baseline, the 16-bit peer-memory one-shot, and auto (by size).
ALGORITHMS = (*SCHEDULES, "nccl", "one_shot", "auto")
ENGINES = ("cpu", "gpu", "auto")
MAX_ROUNDS = 4
DEFAULT_CACHE_BYTES = 1 << 30


@dataclass
class Config:
    engine: str = "auto"
    algorithm: str = "auto"
    group_size: int | None = None         # None: the codec's default (`codec.default_group`)
    codec: str = codec.DEFAULT_CODEC
    crossover_bytes: int | None = None
    timeout: float = 300.0
    rounds: int = 1
    cache_bytes: int = DEFAULT_CACHE_BYTES
    feedback_rounding: bool = True         # the default of `Feedback(rounding=)` for this communicator

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.group_size is None:
            self.group_size = codec.default_group(self.codec)
        codec.check_group_size(self.group_size, self.codec)
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        check_rounds(self.rounds)
        if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {self.cache_bytes!r}")
        if not isinstance(self.feedback_rounding, bool):
            raise ValueError(f"feedback_rounding must be True or False, got {self.feedback_rounding!r}")


def check_rounds(rounds) -> int:
    """``rounds`` if it is an int in [1, MAX_ROUNDS], else `ValueError`."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"rounds must be an int from 1 to {MAX_ROUNDS}, got {rounds!r}")
    return rounds


def boolean(v: str) -> bool:
    """A boolean environment value: 1/0, true/false, on/off, yes/no (any case)."""
    s = v.strip().lower()
    if s in ("1", "true", "on", "yes"):
        return True
    if s in ("0", "false", "off", "no"):
        return False
    raise ValueError(v)


_ENV = {
    "engine": ("ECHONCCL_ENGINE", str),
    "algorithm": ("ECHONCCL_ALGO", str),
    "group_size": ("ECHONCCL_GROUP_SIZE", int),
    "codec": ("ECHONCCL_CODEC", str),
    "crossover_bytes": ("ECHONCCL_CROSSOVER_BYTES", int),
    "timeout": ("ECHONCCL_TIMEOUT", float),
    "rounds": ("ECHONCCL_ROUNDS", int),
    "cache_bytes": ("ECHONCCL_CACHE_BYTES", int),
    "feedback_rounding": ("ECHONCCL_FEEDBACK_ROUNDING", boolean),
}


def resolve(**kwargs) -> Config:
    """A `Config` from keyword arguments (None means default), overridden by the environment."""
    values = {k: v for k, v in kwargs.items() if v is not None}
    for name, (var, conv) in _ENV.items():
        if os.environ.get(var):
            try:
                values[name] = conv(os.environ[var])
            except ValueError:
                raise ValueError(f"{var}={os.environ[var]!r} is not a valid {conv.__name__}") from None
    return Config(**values)


def describe(cfg: Config) -> str:
    return " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in fields(cfg))


def debug_enabled() -> bool:
    return os.environ.get("ECHONCCL_DEBUG", "").upper() in ("INFO", "TRACE")
