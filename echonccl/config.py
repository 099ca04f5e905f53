"""A communicator's options: keyword arguments first, ``ECHONCCL_*`` variables override them.

`resolve` reads the variables (through `settings.get`, at the creation of the `Communicator`)
and checks the result; `Config` holds it. The variables and their meaning: `settings`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from . import codec, settings
from .feedback import DEFAULT_ROUNDING
from .schedules import SCHEDULES

# The 4-bit schedules, the plain baseline, the 16-bit peer-memory one-shot, and auto (by size).
ALGORITHMS = (*SCHEDULES, "nccl", "one_shot", "auto")
ENGINES = ("cpu", "gpu", "auto")
MAX_ROUNDS = 4


@dataclass
class Config:
    engine: str = "auto"
    algorithm: str = "auto"
    codec: str = codec.DEFAULT_CODEC
    crossover_bytes: int | None = None     # None: the engine's measured value for its path
    timeout: float = 300.0
    rounds: int = 1
    cache_bytes: int = 1 << 30
    feedback_rounding: bool = DEFAULT_ROUNDING   # the default of `Feedback(rounding=)` for this communicator
    fused: bool = True                     # peer-memory kernels where the GPUs can map each other's memory

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        codec.check_codec(self.codec)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        check_rounds(self.rounds)
        if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be an int >= 0, got {self.cache_bytes!r}")
        if self.crossover_bytes is not None and (isinstance(self.crossover_bytes, bool)
                                                 or not isinstance(self.crossover_bytes, int)
                                                 or self.crossover_bytes < 0):
            raise ValueError(f"crossover_bytes must be an int >= 0 or None, got {self.crossover_bytes!r}")
        for name in ("feedback_rounding", "fused"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


def check_rounds(rounds) -> int:
    """``rounds`` if it is an int in [1, MAX_ROUNDS], else `ValueError`."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"rounds must be an int from 1 to {MAX_ROUNDS}, got {rounds!r}")
    return rounds


# Each option's variable (`settings`).
ENV = {
    "engine": "ECHONCCL_ENGINE",
    "algorithm": "ECHONCCL_ALGO",
    "codec": "ECHONCCL_CODEC",
    "crossover_bytes": "ECHONCCL_CROSSOVER_BYTES",
    "timeout": "ECHONCCL_TIMEOUT",
    "rounds": "ECHONCCL_ROUNDS",
    "cache_bytes": "ECHONCCL_CACHE_BYTES",
    "feedback_rounding": "ECHONCCL_FEEDBACK_ROUNDING",
    "fused": "ECHONCCL_FUSED",
}


def resolve(**kwargs) -> Config:
    """A `Config` from keyword arguments (None means default), each overridden by its variable
    when that is set. `ValueError` for a bad value names the variable it came from."""
    values = {k: v for k, v in kwargs.items() if v is not None}
    from_env = []
    for name, var in ENV.items():
        if settings.is_set(var):
            values[name] = settings.get(var)
            from_env.append(var)
    try:
        return Config(**values)
    except ValueError as exc:
        if from_env:
            raise ValueError(f"{exc} (set: {', '.join(f'{v}' for v in from_env)})") from None
        raise


def describe(cfg: Config) -> str:
    return " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in fields(cfg))


def debug_enabled() -> bool:
    return settings.get("ECHONCCL_DEBUG") == "INFO"
