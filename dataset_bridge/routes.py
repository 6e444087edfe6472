"""Where the events of which assets go: the routes file shared by the outbox (in Airflow) and the relay.

source: deployment_a                 # how targets know us (their inbox secrets are keyed by it)
targets:
  deployment_b:
    url: https://airflow-b.example/dataset-bridge/inbox
    secret_env: DATASET_BRIDGE_SECRET_B   # the shared secret, from the environment, never the file
    assets: [warehouse://dds/h_user, users_loaded]   # asset URIs or names
    ca_file: /etc/ssl/b-ca.pem       # optional: verify the target's TLS certificate with this CA
    max_attempts: 10                 # optional: refusals (4xx) before an event is dead-lettered
    max_server_errors: 10            # optional: server errors (5xx but 502-504) before it is
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class RoutesError(ValueError):
    """The routes file cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    secret_env: str
    assets: tuple[str, ...]
    ca_file: str | None = None
    max_attempts: int = 10
    max_server_errors: int = 10

    def secret(self) -> str:
        value = os.environ.get(self.secret_env, "")
        if not value:
            raise RoutesError(
                f"target {self.name}: environment variable {self.secret_env} (its shared secret) is not set"
            )
        return value

    def wants(self, uri: str, name: str) -> bool:
        return uri in self.assets or name in self.assets


@dataclass(frozen=True)
class Routes:
    source: str
    targets: tuple[Target, ...]

    @classmethod
    def load(cls, path: str | Path) -> Routes:
        file = Path(path)
        try:
            text = file.read_text()
            raw = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
        except (OSError, yaml.YAMLError, json.JSONDecodeError) as err:
            raise RoutesError(f"{file}: cannot read the routes: {err}") from err
        return cls.parse(raw, source_file=str(file))

    @classmethod
    def parse(cls, raw: Any, *, source_file: str = "routes") -> Routes:
        if not isinstance(raw, dict):
            raise RoutesError(f"{source_file}: expected 'source' and 'targets'")
        source = raw.get("source")
        if not isinstance(source, str) or not _NAME.match(source):
            raise RoutesError(
                f"{source_file}: source must be a name (letters, digits, _ . -), got {source!r}"
            )
        targets = raw.get("targets")
        if not isinstance(targets, dict) or not targets:
            raise RoutesError(f"{source_file}: targets must map target names to their settings")
        return cls(source, tuple(_target(source_file, name, spec) for name, spec in targets.items()))

    def targets_for(self, uri: str, name: str) -> list[Target]:
        return [t for t in self.targets if t.wants(uri, name)]


def _target(source_file: str, name: Any, spec: Any) -> Target:
    where = f"{source_file}: target {name!r}"
    if not isinstance(name, str) or not _NAME.match(name):
        raise RoutesError(f"{where}: the name must be letters, digits, _ . -")
    if not isinstance(spec, dict):
        raise RoutesError(f"{where}: expected url, secret_env and assets")
    url, secret_env, assets = spec.get("url"), spec.get("secret_env"), spec.get("assets")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise RoutesError(f"{where}: url must be an http(s) URL, got {url!r}")
    if not isinstance(secret_env, str) or not secret_env:
        raise RoutesError(f"{where}: secret_env must name the environment variable holding the secret")
    if not isinstance(assets, list) or not assets or not all(isinstance(a, str) and a for a in assets):
        hint = f" (write [{assets!r}])" if isinstance(assets, str) else ""
        raise RoutesError(f"{where}: assets must be a non-empty list of asset URIs or names{hint}")
    attempts = _positive(where, spec, "max_attempts")
    server_errors = _positive(where, spec, "max_server_errors")
    ca_file = spec.get("ca_file")
    if ca_file is not None and not isinstance(ca_file, str):
        raise RoutesError(f"{where}: ca_file must be a path")
    return Target(name, url, secret_env, tuple(assets), ca_file, attempts, server_errors)


def _positive(where: str, spec: dict[str, Any], key: str, default: int = 10) -> int:
    value = spec.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RoutesError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value
