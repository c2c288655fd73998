"""EdgeSyncConfig: defaults < environment < explicit overrides; bad values name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgesync_engines.config import EdgeSyncConfig
from edgesync_store.core import codec
from edgesync_store.settings import default_store_path


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
        ({"EDGESYNC_SEED": "-1"}, "seed"),
        ({"EDGESYNC_SEED": str(2**32 - 1)}, "seed"),
    ],
)
def test_bad_values_name_the_setting(env, name):
    with pytest.raises(ValueError, match=name):
        EdgeSyncConfig.load(environ=env)


def test_unknown_override_is_refused():
    with pytest.raises(ValueError, match="colour"):
        EdgeSyncConfig.load({"colour": "blue"}, environ={})


def test_docs_settings_table_is_the_generated_one():
    """docs/configuration.md's settings table is exactly what ``python -m edgesync_engines.config
    --markdown`` prints, so no setting is documented that the table lacks, and none is missing."""
    import subprocess
    import sys

    from edgesync_engines.config import markdown_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = markdown_table()
    assert table in doc
    rows = [line for line in doc.splitlines() if line.startswith("| `") or line.startswith("| - |")]
    start = doc.index(table.splitlines()[0])
    assert doc[start:start + len(table)] == table
    assert len(table.splitlines()) == 2 + 44 + 3 and len(rows) >= 47
    printed = subprocess.run([sys.executable, "-m", "edgesync_engines.config", "--markdown"],
                             capture_output=True, text=True, check=True).stdout
    assert printed == table



def test_readme_main_options_are_real_settings():
    """README.md's short table of the main options names real settings, each with its own
    variable and default as the full table shows them (docs/configuration.md)."""
    from edgesync_engines.config import BY_NAME

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Main options\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    assert len(rows) >= 8
    for name, env, default, _ in rows:
        s = BY_NAME[name.strip("`")]
        assert env == f"`{s.env}`" and default.startswith(s.shown_default()), name

def test_table_defines_fields_defaults_and_variables():
    """Every EdgeSyncConfig field is a row of SETTINGS with its default, environment variable and
    help; the defaults owned by the store are the store's own constants."""
    import dataclasses

    from edgesync_engines.config import BY_NAME, SETTINGS
    from edgesync_store.core.store import DEFAULT_MAX_BYTES
    from edgesync_store.semantic.index import DEFAULT_EF_SEARCH
    from edgesync_store.settings import DEFAULT_COMPACT_INTERVAL_S, DEFAULT_SWEEP_INTERVAL_S
    from edgesync_store.ttl import DEFAULT_TTL_SECONDS

    fields = [f.name for f in dataclasses.fields(EdgeSyncConfig)]
    assert fields == [s.name for s in SETTINGS] and len(fields) == 44
    assert len({s.env for s in SETTINGS}) == 44 and all(s.env.startswith("EDGESYNC_") and s.help for s in SETTINGS)
    cfg = EdgeSyncConfig.load(environ={})
    assert cfg.ef_search == DEFAULT_EF_SEARCH == 100
    from edgesync_engines.config import EMBEDDING_BACKENDS
    from edgesync_store.semantic.embedders import BACKENDS, DEFAULT_BACKEND
    assert EMBEDDING_BACKENDS == tuple(BACKENDS) and cfg.embedding_backend == DEFAULT_BACKEND
    assert (cfg.reuse, cfg.blend_recompute, cfg.document_header) == ("exact", 0.15, "chat")
    assert cfg.ttl_seconds == float(DEFAULT_TTL_SECONDS) == 1800.0
    assert cfg.compression == codec.DEFAULT_COMPRESSION == "none"
    assert BY_NAME["compression"].env == "EDGESYNC_COMPRESSION"
    assert EdgeSyncConfig.load(environ={"EDGESYNC_COMPRESSION": " ZSTD "}).compression == "zstd"
    with pytest.raises(ValueError, match=r"^compression: 'gzip' is not one of none, zstd"):
        EdgeSyncConfig.load(environ={"EDGESYNC_COMPRESSION": "gzip"})
    assert (cfg.sweep_interval_s, cfg.compact_interval_s) == (DEFAULT_SWEEP_INTERVAL_S, DEFAULT_COMPACT_INTERVAL_S)
    assert (DEFAULT_SWEEP_INTERVAL_S, DEFAULT_COMPACT_INTERVAL_S) == (60.0, 900.0)
    assert cfg.max_bytes is None and "8 GiB" in BY_NAME["max_bytes"].shown_default() and DEFAULT_MAX_BYTES == 8 << 30
    assert cfg.to_dict()["store_path"] == str(default_store_path()) and list(cfg.to_dict()) == fields


def test_the_ram_tier_default_is_small_beside_a_long_context():
    """64 MiB of decoded K + V: four 128-token chunks of Llama-3.1-8B's f16 KV, 1/64 of a
    32K-token context of it (docs/configuration.md): a hit adds at most that beside the KV cache."""
    from dataclasses import replace

    from fragments import SMOL

    from edgesync_engines.config import DEFAULT_RAM_TIER_BYTES
    from edgesync_engines.request.storeback import context_kv_bytes

    llama8b = replace(SMOL, n_layer=32, n_head_kv=8, head_dim=128)
    assert EdgeSyncConfig.load(environ={}).ram_tier_bytes == DEFAULT_RAM_TIER_BYTES == 64 << 20
    assert DEFAULT_RAM_TIER_BYTES == 4 * context_kv_bytes(llama8b, 128)
    assert 64 * DEFAULT_RAM_TIER_BYTES == context_kv_bytes(llama8b, 32768)


def test_checks_once_for_constructor_and_load(tmp_path):
    """The same check runs for direct construction and for load, with the variable named only
    when the bad value came from the environment; the chunk span limits are the schema's."""
    with pytest.raises(ValueError, match=r"^chunk_tokens: 1986 must be in \[64, 1985\]$"):
        EdgeSyncConfig(chunk_tokens=1986)
    from_env = r"^chunk_tokens: 1986 must be in \[64, 1985\] \(from EDGESYNC_CHUNK_TOKENS='1986'\)$"
    with pytest.raises(ValueError, match=from_env):
        EdgeSyncConfig.load(environ={"EDGESYNC_CHUNK_TOKENS": "1986"})
    assert EdgeSyncConfig.load(environ={"EDGESYNC_CHUNK_TOKENS": "1985"}).chunk_tokens == 1985
    with pytest.raises(ValueError, match=r"^n_threads: must be in \[1, 256\], got 0$"):
        EdgeSyncConfig.load({"n_threads": 0}, environ={"EDGESYNC_THREADS": "2"})
    with pytest.raises(ValueError, match=r"^EDGESYNC_MAX_BYTES='lots': not a size in bytes"):
        EdgeSyncConfig.load(environ={"EDGESYNC_MAX_BYTES": "lots"})
    assert EdgeSyncConfig.load(environ={"EDGESYNC_MAX_BYTES": "512M"}).max_bytes == 512 * 1024 * 1024
    # sizes are exact up to the largest file offset, refused past it (the store records a u64)
    largest = str(2**63 - 1)
    assert EdgeSyncConfig.load(environ={"EDGESYNC_MAX_BYTES": largest}).max_bytes == 2**63 - 1
    assert EdgeSyncConfig.load(environ={"EDGESYNC_MAX_BYTES": "1.5K"}).max_bytes == 1536
    with pytest.raises(ValueError, match=r"^EDGESYNC_MAX_BYTES='1.5': not a whole number of bytes"):
        EdgeSyncConfig.load(environ={"EDGESYNC_MAX_BYTES": "1.5"})
    for text in ("20000000T", str(2**63)):
        with pytest.raises(ValueError, match=rf"^EDGESYNC_MAX_BYTES='{text}': must be at most {largest} bytes"):
            EdgeSyncConfig.load(environ={"EDGESYNC_MAX_BYTES": text})
    for name in ("max_bytes", "ram_tier_bytes"):
        with pytest.raises(ValueError, match=rf"^{name}: must be .* to {largest}.*, got {2**64}$"):
            EdgeSyncConfig(**{name: 2**64})
    with pytest.raises(ValueError,
                       match=r"^reuse: 'semantic' needs the semantic lookup.*\(from EDGESYNC_REUSE='semantic'\)$"):
        EdgeSyncConfig.load({"semantic": False}, environ={"EDGESYNC_REUSE": "semantic"})
    with pytest.raises(ValueError, match=r"^similarity_partial: 0.8 is above similarity_exact 0.7$"):
        EdgeSyncConfig(similarity_exact=0.7, similarity_partial=0.8)
    cfg = EdgeSyncConfig(store_path=str(tmp_path), engine=" ONNX ")
    assert cfg.store_path == tmp_path and cfg.engine == "onnx"


def test_kv_type_is_checked_and_named():
    """EDGESYNC_KV_TYPE takes the adapter's KV types only, and a bad one names the variable."""
    from edgesync_engines.config import KV_TYPES

    assert EdgeSyncConfig.load(environ={"EDGESYNC_KV_TYPE": "q8_0"}).kv_type == "q8_0"
    assert EdgeSyncConfig.load(environ={}).kv_type == "f16" and KV_TYPES == ("f16", "f32", "q8_0", "q4_0")
    bad = r"^kv_type: 'q5_k' is not one of f16, f32, q8_0, q4_0 \(from EDGESYNC_KV_TYPE"
    with pytest.raises(ValueError, match=bad):
        EdgeSyncConfig.load(environ={"EDGESYNC_KV_TYPE": "q5_k"})


def test_config_is_declared_and_reuses_the_store_settings(tmp_path):
    """EdgeSyncConfig's fields are declared (type checkers and ``typing.get_type_hints`` see them);
    the store's settings are StoreSettings' own declarations (same type, default, variable, check
    and help), loaded the same way."""
    import dataclasses
    import typing

    from edgesync_engines.config import BY_NAME
    from edgesync_store.remote.url import RemoteURL
    from edgesync_store.settings import StoreSettings, table

    hints = typing.get_type_hints(EdgeSyncConfig)
    assert hints["reuse"] is str and hints["n_threads"] == int | None and hints["remote_url"] == RemoteURL | None
    assert list(hints) == [f.name for f in dataclasses.fields(EdgeSyncConfig)]
    store_hints = typing.get_type_hints(StoreSettings)
    for row in table(StoreSettings):
        assert BY_NAME[row.name] == row and hints[row.name] == store_hints[row.name]
    assert [s.name for s in table(StoreSettings)] == ["store_path", "ttl_seconds", "max_bytes", "compression",
                                                      "jobs", "sweep_interval_s", "compact_interval_s"]
    cfg = EdgeSyncConfig.load({"store_path": str(tmp_path), "max_bytes": 1 << 20}, environ={"EDGESYNC_JOBS": "off"})
    store = StoreSettings.load({"store_path": str(tmp_path), "max_bytes": 1 << 20}, environ={"EDGESYNC_JOBS": "off"})
    assert store == StoreSettings(store_path=tmp_path, max_bytes=1 << 20, jobs=False)
    assert {name: value for name, value in cfg.to_dict().items() if name in store.to_dict()} == store.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.reuse = "blend"  # type: ignore[misc]


def test_a_number_that_does_not_parse_is_named_in_words():
    with pytest.raises(ValueError, match=r"^EDGESYNC_N_CTX='abc': not a whole number$"):
        EdgeSyncConfig.load(environ={"EDGESYNC_N_CTX": "abc"})
    with pytest.raises(ValueError, match=r"^EDGESYNC_TOP_P='0,9': not a number$"):
        EdgeSyncConfig.load(environ={"EDGESYNC_TOP_P": "0,9"})
