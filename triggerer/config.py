"""``[smart_triggerer]`` settings (env ``AIRFLOW__SMART_TRIGGERER__<KEY>``), validated once at start."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A ``[smart_triggerer]`` setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class Settings:
    shards: int = 64
    lease_seconds: float = 8.0
    dedup: bool = True
    dedup_classpaths: tuple[str, ...] = ()
    health_port: int | None = None
    # Airflow 3.3.2 fails a task resumed within ~5 s of its deferral (apache/airflow#71580 family):
    # an event for a member that deferred more recently than this is held back until it is old enough.
    resume_hold_seconds: float = 6.0
    loop_seconds: float = 1.0
    # every N loops the full membership of owned shards is re-read (departures); new rows every loop
    reconcile_every: int = 5
    # coroutines started per loop (Airflow builds each workload with a few queries)
    max_new_per_loop: int = 250
    # task instances resumed in one transaction (bounds lock time and the cost of one refused batch)
    max_resumes_per_transaction: int = 2000

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ConfigError(f"[smart_triggerer] shards must be >= 1, got {self.shards}")
        if self.lease_seconds < 3 * self.loop_seconds:
            raise ConfigError(
                f"[smart_triggerer] lease_seconds must be at least 3 loops ({3 * self.loop_seconds}s), "
                f"got {self.lease_seconds}"
            )
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ConfigError(f"[smart_triggerer] health_port must be 0-65535, got {self.health_port}")
        if self.resume_hold_seconds < 0:
            raise ConfigError("[smart_triggerer] resume_hold_seconds must be >= 0")

    @classmethod
    def from_airflow(cls) -> Settings:
        from airflow.configuration import conf

        section = "smart_triggerer"
        try:
            port = conf.get(section, "health_port", fallback="")
            return cls(
                shards=conf.getint(section, "shards", fallback=cls.shards),
                lease_seconds=conf.getfloat(section, "lease_seconds", fallback=cls.lease_seconds),
                dedup=conf.getboolean(section, "dedup", fallback=cls.dedup),
                dedup_classpaths=_split(conf.get(section, "dedup_classpaths", fallback="")),
                health_port=int(port) if str(port).strip() else None,
                resume_hold_seconds=conf.getfloat(section, "resume_hold_seconds",
                                                  fallback=cls.resume_hold_seconds),
                loop_seconds=conf.getfloat(section, "loop_seconds", fallback=cls.loop_seconds),
            )
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"[smart_triggerer] has an invalid value: {err}") from err


def _split(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())
