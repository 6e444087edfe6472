"""The limits every triggerer connection starts with (bounded.py), for a given lease."""

from __future__ import annotations

from smart_triggerer.db.bounded import connect_params, limits


def test_every_wait_ends_within_half_a_lease() -> None:
    found = limits(8.0)
    assert found["lock_timeout"] == 2000 and found["idle_in_transaction_session_timeout"] == 4000
    assert found["tcp_user_timeout"] == 4000
    idle, interval, count = (found[f"tcp_keepalives_{k}"] for k in ("idle", "interval", "count"))
    detection = idle + interval * count
    assert detection <= 8.0 / 2


def test_options_already_given_are_kept_and_ours_follow() -> None:
    params = connect_params(6.0, "-c search_path=airflow")
    assert params["options"].startswith("-c search_path=airflow -c lock_timeout=1500 ")
    assert "-c idle_in_transaction_session_timeout=3000" in params["options"]
    assert params["options"].endswith(" -c jit=off")  # never compiled: see bounded.py
    assert params["keepalives"] == 1 and params["tcp_user_timeout"] == 3000
    assert connect_params(6.0)["options"].startswith("-c lock_timeout=1500")
