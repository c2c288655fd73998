"""EdgeSyncConfig: defaults < environment < explicit overrides; bad values name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgesync_engines.config import EdgeSyncConfig, default_store_path


def test_precedence_defaults_environment_overrides(tmp_path):
    env = {"EDGESYNC_STORE": str(tmp_path / "env-store"), "EDGESYNC_CHUNK_TOKENS": "96", "EDGESYNC_FLASH_ATTN": "yes"}
    assert EdgeSyncConfig.load(environ={}).store_path == default_store_path()
    assert EdgeSyncConfig.load(environ={}).n_ctx >= 4096
    from_env = EdgeSyncConfig.load(environ=env)
    assert from_env.store_path == tmp_path / "env-store"
    assert from_env.chunk_tokens == 96 and from_env.flash_attn is True
    overridden = EdgeSyncConfig.load({"store_path": str(tmp_path / "cli"), "chunk_tokens": None}, environ=env)
    assert overridden.store_path == Path(tmp_path / "cli")
    assert overridden.chunk_tokens == 96  # None means "not given on the command line"


@pytest.mark.parametrize(
    "env, name",
    [
        ({"EDGESYNC_N_CTX": "lots"}, "EDGESYNC_N_CTX"),
        ({"EDGESYNC_CACHE": "maybe"}, "EDGESYNC_CACHE"),
        ({"EDGESYNC_CHUNK_TOKENS": "32"}, "chunk_tokens"),
        ({"EDGESYNC_TOP_P": "1.5"}, "top_p"),
        ({"EDGESYNC_MAX_TOKENS": "0"}, "max_tokens"),
    ],
)
def test_bad_values_name_the_setting(env, name):
    with pytest.raises(ValueError, match=name):
        EdgeSyncConfig.load(environ=env)


def test_unknown_override_is_refused():
    with pytest.raises(ValueError, match="colour"):
        EdgeSyncConfig.load({"colour": "blue"}, environ={})
