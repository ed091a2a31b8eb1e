"""The router's config refuses numbers it cannot work with (NaN, infinity,
zero or negative where a positive is needed) when it is loaded, naming the
key, instead of answering every request with a 500 or spinning later."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvstore.errors import InvalidArgument
from router.config import load_router_config

BACKEND = '[[backend]]\nname = "a"\nurl = "http://127.0.0.1:9001"\n'
PD = BACKEND + '[[backend]]\nname = "d"\nurl = "http://127.0.0.1:9002"\n'


@pytest.mark.parametrize("toml,key", [
    # a tenant's infinite token rate: every request of that tenant was a 500 (TokenBucket refuses inf)
    ('[[tenant]]\nname = "t"\ntokens_per_s = inf\n', "tenant[t].tokens_per_s"),
    ('[[tenant]]\nname = "t"\ntokens_per_s = 10.0\ntoken_burst = inf\n', "tenant[t].token_burst"),
    ('[[tenant]]\nname = "t"\nrequests_per_s = nan\n', "tenant[t].requests_per_s"),
    ('[default_tenant_quota]\ntokens_per_s = inf\n', "tenant[*].tokens_per_s"),
    # a NaN or infinite per-decode penalty made every prediction NaN/inf: every request a 500
    ('[predictor]\ndecode_penalty_s = nan\n', "predictor.decode_penalty_s"),
    ('[predictor]\ndecode_penalty_s = inf\n', "predictor.decode_penalty_s"),
    ('[predictor]\nprefill_overhead_s = nan\n', "predictor.prefill_overhead_s"),
    ('[predictor]\nremote_Bps = nan\n', "predictor.remote_Bps"),
    ('[predictor]\nssd_Bps = inf\n', "predictor.ssd_Bps"),
    # an infinite class target: the admission controller refuses it on every request (a 500)
    ('[[class]]\nname = "default"\nttft_slo = inf\n', "class[default].ttft_slo"),
    # a NaN visibility wait never ended (the deadline comparison is always false)
    (PD + '[pd]\nprefill = ["a"]\ndecode = ["d"]\nvisible_timeout = nan\n', "pd.visible_timeout"),
    # a zero health interval spun the health loop and timed every check out at once
    ('health_interval = 0.0\n', "health_interval"),
    ('health_interval = nan\n', "health_interval"),
    ('connect_timeout = -1.0\n', "connect_timeout"),
    ('first_byte_timeout = nan\n', "first_byte_timeout"),
    ('read_timeout = inf\n', "read_timeout"),
    ('max_prompt_tokens = -1\n', "max_prompt_tokens"),
    # a zero or NaN answer limit cut every answer (or none)
    ('max_response_bytes = 0\n', "max_response_bytes"),
    ('max_response_bytes = nan\n', "max_response_bytes"),
    ('max_response_bytes = inf\n', "max_response_bytes"),
])
def test_non_finite_or_out_of_range_numbers_are_refused_naming_the_key(tmp_path: Any, toml: str, key: str) -> None:
    path = tmp_path / "router.toml"
    path.write_text(toml if toml.startswith(PD) else toml + BACKEND)  # top-level keys before the tables
    with pytest.raises(InvalidArgument, match=re.escape(f"router config: {key} =")):
        load_router_config(str(path))


def test_finite_numbers_still_load(tmp_path: Any) -> None:
    path = tmp_path / "router.toml"
    path.write_text('health_interval = 0.5\nread_timeout = 30.0\nmax_prompt_tokens = 0\n' + PD +
                    '[[tenant]]\nname = "t"\ntokens_per_s = 100.0\ntoken_burst = 0.0\n'
                    '[predictor]\ndecode_penalty_s = 0.0\nremote_Bps = 0.0\n'
                    '[pd]\nprefill = ["a"]\ndecode = ["d"]\nvisible_timeout = 0.0\n')
    cfg = load_router_config(str(path))
    assert cfg.health_interval == 0.5 and cfg.tenants[0].tokens_per_s == 100.0 and cfg.pd is not None


@pytest.mark.parametrize("toml,key", [
    # each was a TypeError/AttributeError traceback out of `kvstore route --config`
    ('listen = 5\n', "listen"),
    ('retries = "x"\n', "retries"),
    ('headroom = "x"\n', "headroom"),
    ('max_body_bytes = "16MiB"\n', "max_body_bytes"),
    ('[[model]]\nname = "m"\npath = 5\n', "model[0].path"),
    ('[[backend]]\nname = "b"\nurl = "http://127.0.0.1:9003"\ndaemon = 5\n', "backend[0].daemon"),
    # each was taken as it came: the string "false" is true, so admission stayed on
    ('admission = "false"\n', "admission"),
    ('log_decisions = 0\n', "log_decisions"),
    ('[[backend]]\nname = "b"\nurl = "http://127.0.0.1:9003"\ncluster = "no"\n', "backend[0].cluster"),
    ('[[class]]\nname = 5\n', "class[0].name"),
    ('[[model]]\nname = "m"\npath = "/m"\nblock_size = true\n', "model[0].block_size"),
])
def test_values_of_the_wrong_type_are_refused_naming_the_key(tmp_path: Any, toml: str, key: str) -> None:
    path = tmp_path / "router.toml"
    path.write_text(toml + BACKEND)
    with pytest.raises(InvalidArgument, match=re.escape(f"router config: {key} =")):
        load_router_config(str(path))
