"""The guards plugin through the pipeline: tool allow/deny lists and the path guard."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

from dsh_core import ToolExecution, define_tool, hookimpl
from dsh_core.abort import AbortSignal
from dsh_core.model import ExecutionToken
from dsh_core.testing.loader import load_plugin
from dsh_plugins.guards import glob_to_regex

pytestmark = pytest.mark.anyio


def rows(root: Path, **guards: object) -> list[dict[str, object]]:
    """workspace + bash + guards rows rooted at ``root``."""
    return [
        {"id": "workspace", "use": "workspace", "config": {"root": str(root)}},
        {"id": "bash", "use": "bash", "config": {"root": str(root)}},
        {"id": "guards", "use": "guards", "config": {"root": str(root), **guards}},
    ]


async def test_tool_deny_and_allow_lists(boot: Any, tmp_path: Path) -> None:
    """deny_tools denies matching names; a non-empty allow_tools denies everything else."""
    async with boot(*rows(tmp_path, deny_tools=["ba*"])) as h:
        denied = await h.call("bash", {"command": "touch x"})
        assert denied.code == "DENIED"
        assert 'guards: tool "bash" is denied (deny_tools pattern "ba*"' in denied.text
        assert (await h.call("list", {})).error is None
    async with boot(*rows(tmp_path, allow_tools=["read", "list"])) as h:
        assert (await h.call("list", {})).error is None
        denied = await h.call("write", {"path": "y", "content": ""})
        assert denied.code == "DENIED" and 'tool "write" is not in allow_tools' in denied.text
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


async def test_deny_paths_cover_relative_absolute_and_symlinked_spellings(boot: Any, tmp_path: Path) -> None:
    """A denied glob matches the given path and where its symlinks lead; absolute globs match absolute paths."""
    (tmp_path / ".env").write_text("SECRET=1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "alias").symlink_to(tmp_path / ".env")
    (tmp_path / "notes.txt").write_text("ok\n")
    async with boot(*rows(tmp_path, deny_paths=["**/.env", f"{tmp_path}/private/**"])) as h:
        for path in (
            ".env",
            "sub/../.env",
            str(tmp_path / ".env"),
            "sub/alias",
            "private/key.pem",
            "/" + str(tmp_path / "private/key.pem"),
        ):
            result = await h.call("read", {"path": path})
            assert result.code == "DENIED", path
            assert f'guards: path "{path}" (argument "path") matches the denied pattern' in result.text
        assert (await h.call("read", {"path": "notes.txt"})).error is None
        assert (await h.call("read", {"path": "/" + str(tmp_path / "notes.txt")})).error is None


async def test_allowed_roots_deny_paths_outside(boot: Any, tmp_path: Path) -> None:
    """Paths outside every allowed root are denied (before the tool could even try)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x\n")
    (tmp_path / "docs.txt").write_text("y\n")
    async with boot(*rows(tmp_path, allowed_roots=["src"])) as h:
        assert (await h.call("read", {"path": "src/a.py"})).error is None
        denied = await h.call("write", {"path": "docs.txt", "content": "pwned"})
        assert denied.code == "DENIED"
        assert f"resolves to {tmp_path.resolve()}/docs.txt, outside the allowed roots" in denied.text
    assert (tmp_path / "docs.txt").read_text() == "y\n"


def execution(arguments: object) -> ToolExecution:
    """A call of a tool ``t`` with these arguments, for the guard hook alone."""
    return ToolExecution(
        call_id="c",
        root_call_id="c",
        name="t",
        arguments=arguments,
        signal=AbortSignal.never(),
        agent=None,
        parent=None,
        token=ExecutionToken(),
    )


async def guard_verdicts(config: dict[str, Any], *paths: str) -> list[str | None]:
    """The guard's verdict (denial reason or None) on a ``path`` argument of each of ``paths``."""
    loaded = await load_plugin("guards", config)
    try:
        return [await loaded.hooks.guard(execution({"path": path})) for path in paths]
    finally:
        await loaded.dispose()


async def test_custom_path_arguments_and_lists(tmp_path: Path) -> None:
    """path_arguments chooses which argument names hold paths; list values are checked item by item."""
    loaded = await load_plugin("guards", {"root": str(tmp_path), "deny_paths": ["*.key"], "path_arguments": ["files"]})
    try:
        assert await loaded.hooks.guard(execution({"files": ["a.txt", "b.key"]})) is not None
        assert await loaded.hooks.guard(execution({"files": ["a.txt"]})) is None
        assert await loaded.hooks.guard(execution({"path": "b.key"})) is None  # not a path argument here
    finally:
        await loaded.dispose()


async def test_extend_path_arguments_adds_names_and_path_arguments_replaces_the_defaults(tmp_path: Path) -> None:
    """As ruff's select/extend-select: path_arguments = ["target"] alone stops judging path, file and the other
    defaults (a footgun for a deny list); extend_path_arguments judges its names in addition to them."""
    rules = {"root": str(tmp_path), "deny_paths": ["*.key"]}
    loaded = await load_plugin("guards", {**rules, "extend_path_arguments": ["target"]})
    try:
        assert await loaded.hooks.guard(execution({"target": "b.key"})) is not None
        assert await loaded.hooks.guard(execution({"path": "b.key"})) is not None  # the defaults still hold
        assert await loaded.hooks.guard(execution({"file": "b.key"})) is not None
        assert await loaded.hooks.guard(execution({"target": "a.txt"})) is None
    finally:
        await loaded.dispose()
    loaded = await load_plugin("guards", {**rules, "path_arguments": ["files"], "extend_path_arguments": ["target"]})
    try:
        assert await loaded.hooks.guard(execution({"target": "b.key"})) is not None
        assert await loaded.hooks.guard(execution({"files": ["b.key"]})) is not None
        assert await loaded.hooks.guard(execution({"path": "b.key"})) is None  # replaced: not judged
    finally:
        await loaded.dispose()


@pytest.mark.parametrize("key", ["path_arguments", "extend_path_arguments"])
@pytest.mark.parametrize("value", ["target", [""], [1]])
async def test_path_argument_lists_are_validated_alike(tmp_path: Path, key: str, value: object) -> None:
    """Both lists take non-empty names only, and the config error names the key."""
    from dsh_core.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=rf"config for plugin 'guards' does not match its config schema: "
        rf"{key}(/0)?: ",
    ):
        await load_plugin("guards", {"root": str(tmp_path), key: value})


def test_glob_translation() -> None:
    """* and ? stay in a segment, ** spans segments, classes work."""
    assert glob_to_regex("**/.env").match(".env")
    assert glob_to_regex("**/.env").match("a/b/.env")
    assert not glob_to_regex("*.py").match("a/b.py")
    assert glob_to_regex("src/**").match("src/a/b.py")
    assert glob_to_regex("file?.[ch]").match("file1.c")
    assert not glob_to_regex("file?.[!ch]").match("file1.c")


async def test_path_guard_checks_the_file_the_workspace_tool_opens(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paths resolve against the guard root (not the cwd); outside paths fail closed under relative deny globs."""
    ws, elsewhere = tmp_path / "ws", tmp_path / "elsewhere"
    for base in (ws, elsewhere):
        (base / "secrets").mkdir(parents=True)
        (base / "secrets" / "key").write_text("k\n")
    (ws / "notes.txt").write_text("ok\n")
    (tmp_path / "outside.txt").write_text("o\n")
    monkeypatch.chdir(elsewhere)
    async with boot(*rows(ws, deny_paths=["secrets/**"])) as h:
        for path in ("secrets/key", str(ws / "secrets" / "key"), "~/../secrets/key", "notes.txt/../secrets/key"):
            result = await h.call("read", {"path": path})
            assert result.code == "DENIED", path
            assert 'matches the denied pattern "secrets/**"' in result.text
        outside = await h.call("read", {"path": str(tmp_path / "outside.txt")})
        assert outside.code == "DENIED"
        assert (
            f"outside the guard root {ws.resolve()}, where the relative deny_paths patterns of plugin row "
            '"guards" (1 pattern) cannot be checked' in outside.text
        )
        assert (await h.call("read", {"path": "../outside.txt"})).code == "DENIED"
        assert (await h.call("read", {"path": "notes.txt"})).error is None
        assert (await h.call("read", {"path": str(ws / "notes.txt")})).error is None


async def test_a_path_outside_the_root_is_denied_without_listing_the_deny_patterns(boot: Any, tmp_path: Path) -> None:
    """The denial of a path outside the root names the rule (the relative deny_paths of the row, counted), not
    every pattern: one call naming "/" read back the whole deny list, file names the guard keeps from list
    and search included (they withhold entries without naming them), where a pattern denial names only the
    pattern that matched the path the model gave."""
    (tmp_path / "ws").mkdir()
    patterns = ["finance/2026-layoffs.xlsx", "**/.env"]
    async with boot(*rows(tmp_path / "ws", deny_paths=patterns)) as h:
        denied = await h.call("read", {"path": str(tmp_path)})
    assert denied.code == "DENIED"
    assert 'relative deny_paths patterns of plugin row "guards" (2 patterns) cannot be checked' in denied.text
    assert not any(pattern in denied.text for pattern in patterns), denied.text


async def test_path_rules_require_a_root(boot: Any, tmp_path: Path) -> None:
    """Without root, deny_paths would be checked against the cwd: the row refuses to load."""
    with pytest.raises(Exception, match="sets deny_paths or allowed_roots but no root"):
        async with boot(
            {"id": "workspace", "use": "workspace", "config": {"root": str(tmp_path)}},
            {"id": "guards", "use": "guards", "config": {"deny_paths": ["secrets/**"]}},
        ):
            pass  # pragma: no cover


async def test_default_deployment_guards_the_workspace_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default deployment roots the guards row at the workspace, so rules added to it check the right files."""
    from dsh_core.config import default_deployment

    monkeypatch.chdir(tmp_path)
    deployment = default_deployment(tmp_path / "ws", env={})
    guards = next(row for row in deployment.plugins if row.id == "guards")
    assert guards.config == {"root": str(tmp_path / "ws")}


async def test_absolute_deny_paths_hold_through_symlinked_roots_and_prefixes(boot: Any, tmp_path: Path) -> None:
    """An absolute glob matches however the root or the glob spells the directory (symlinks on either side)."""
    real, link = tmp_path / "real", tmp_path / "link"
    (real / "secrets").mkdir(parents=True)
    (real / "secrets" / "key").write_text("k\n")
    (real / "notes.txt").write_text("ok\n")
    link.symlink_to(real)  # the root spelled through a symlink, like /tmp or /var on macOS
    (real / "alias").symlink_to(real / "secrets")  # a glob prefix that is a symlink inside the root
    (tmp_path / "shortcut").symlink_to(real / "secrets")  # ... and one outside it
    async with boot(*rows(link, deny_paths=[f"{link}/secrets/**"])) as h:  # the reported case, end to end
        result = await h.call("read", {"path": "secrets/key"})
        assert result.code == "DENIED" and f'matches the denied pattern "{link}/secrets/**"' in result.text
        assert (await h.call("read", {"path": "notes.txt"})).error is None
    for deny in (
        f"{link}/secrets/**",
        f"{real}/secrets/**",
        f"{real}/alias/**",
        f"{tmp_path}/shortcut/*",
        f"{link}/alias/[k]ey",
    ):
        verdicts = await guard_verdicts(
            {"root": str(link), "deny_paths": [deny]},
            "secrets/key",
            "alias/key",
            str(real / "secrets/key"),
            "notes.txt",
        )
        assert all(f'matches the denied pattern "{deny}"' in str(v) for v in verdicts[:3]), (deny, verdicts)
        assert verdicts[3] is None
    for deny in (f"{link}/secrets", f"{tmp_path}/shortcut"):  # a glob-free pattern: the directory itself
        assert [v is None for v in await guard_verdicts({"root": str(link), "deny_paths": [deny]}, "secrets", ".")] == [
            False,
            True,
        ], deny
    # The root's own spelling counts as inside it, for absolute and relative globs alike.
    verdicts = await guard_verdicts(
        {"root": str(link), "deny_paths": ["secrets/**", f"{link}/notes.txt"]},
        str(link / "secrets/key"),
        str(link / "notes.txt"),
        str(link / "other"),
    )
    assert [v and v.split(" (argument")[0] for v in verdicts[:2]] == [
        f'guards: path "{link}/secrets/key"',
        f'guards: path "{link}/notes.txt"',
    ]
    assert all("matches the denied pattern" in str(v) for v in verdicts[:2])
    assert verdicts[2] is None


async def test_deny_paths_are_normalised_like_the_paths_they_judge(boot: Any, tmp_path: Path) -> None:
    """ "./x", "x/" (the directory and all under it), "x//y", "x/./y" match; a ".." glob is refused at load."""
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "key").write_text("k\n")
    (tmp_path / "notes.txt").write_text("ok\n")
    async with boot(*rows(tmp_path, deny_paths=["./secrets/"])) as h:  # the reported spellings, end to end
        result = await h.call("read", {"path": "secrets/key"})
        assert result.code == "DENIED" and 'matches the denied pattern "./secrets/"' in result.text
        assert (await h.call("list", {"path": "secrets"})).code == "DENIED"
        assert (await h.call("read", {"path": "notes.txt"})).error is None
    for deny in (
        "./secrets/**",
        "secrets/",
        "./secrets/",
        "secrets//key",
        "././secrets/./key",
        f"{tmp_path}//secrets/",
        f"{tmp_path}/./secrets/key",
        "**/secrets/",
    ):
        verdicts = await guard_verdicts(
            {"root": str(tmp_path), "deny_paths": [deny]}, "secrets/key", "notes.txt", "secrets"
        )
        assert f'matches the denied pattern "{deny}"' in str(verdicts[0]), (deny, verdicts)
        assert verdicts[1] is None
        assert (verdicts[2] is not None) == deny.endswith("/"), deny  # "x/" is the directory too
    assert None not in await guard_verdicts({"root": str(tmp_path), "deny_paths": ["./"]}, "notes.txt", ".")
    for deny in ("../secrets/**", "secrets/../notes.txt", f"{tmp_path}/sub/../secrets/**", "**/.."):
        with pytest.raises(Exception, match=re.escape(f'deny_paths pattern "{deny}" of plugin row "guards"')):
            async with boot(*rows(tmp_path, deny_paths=[deny])):
                pass  # pragma: no cover


async def test_a_tilde_glob_that_cannot_be_expanded_is_refused(boot: Any, tmp_path: Path) -> None:
    """ "~nosuchuser/..." would silently become a relative glob under root: the row refuses to load."""
    deny = "~dsh-no-such-user-xyz/secrets/**"
    with pytest.raises(Exception, match=re.escape(f'deny_paths pattern "{deny}" of plugin row "guards" starts')):
        async with boot(*rows(tmp_path, deny_paths=[deny])):
            pass  # pragma: no cover
    # A directory named "~x" inside the root is still deniable, spelled "./~x".
    (tmp_path / "~x").mkdir()
    (tmp_path / "~x" / "key").write_text("k\n")
    async with boot(*rows(tmp_path, deny_paths=["./~x/"])) as h:
        assert (await h.call("read", {"path": "~x/key"})).code == "DENIED"


async def test_a_symlink_before_dotdot_is_judged_where_the_system_resolves_it(tmp_path: Path) -> None:
    """ "link/../x" is x beside the link's target for open(); the guard judges that file, not root/x."""
    (tmp_path / "vault" / "inner").mkdir(parents=True)
    (tmp_path / "vault" / "secrets").mkdir()
    (tmp_path / "vault" / "secrets" / "key").write_text("k\n")
    (tmp_path / "link").symlink_to(tmp_path / "vault" / "inner")
    path = "link/../secrets/key"
    assert (tmp_path / path).read_text() == "k\n"  # what a tool opening root/path reads
    verdicts = await guard_verdicts(
        {"root": str(tmp_path), "deny_paths": ["vault/secrets/**"]}, path, "link/../notes.txt"
    )
    assert verdicts[0] is not None and 'matches the denied pattern "vault/secrets/**"' in verdicts[0]
    assert verdicts[1] is None  # vault/notes.txt (or notes.txt): allowed


async def test_deny_paths_fold_case_when_the_root_ignores_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a case-insensitive file system (macOS, Windows shares) ".ENV" opens .env: globs then fold case."""
    from dsh_plugins import guards

    config = {"root": str(tmp_path), "deny_paths": ["**/.env", f"{tmp_path}/secrets/"]}
    with monkeypatch.context() as patch:
        patch.setattr(guards, "_case_insensitive", lambda directory: True, raising=False)
        verdicts = await guard_verdicts(
            config, ".ENV", "sub/.Env", "SECRETS/key", str(tmp_path / "Secrets"), "notes.txt"
        )
    assert [verdict is not None for verdict in verdicts] == [True, True, True, True, False]
    # The probe: a name in the root looked up with its case swapped (else the root itself, from its parent).
    (tmp_path / "empty").mkdir()
    (tmp_path / "Probe").write_text("")
    swapped = (tmp_path / "pROBE").exists()
    assert guards._case_insensitive(str(tmp_path)) is swapped
    assert guards._case_insensitive(str(tmp_path / "empty")) is swapped
    assert (await guard_verdicts(config, ".ENV") != [None]) is swapped


def _mount(patch: pytest.MonkeyPatch, root: Path, *, root_folds: bool, parent_folds: bool) -> None:
    """Make ``root`` look like the mount point of another file system (its own ``st_dev``), and let the
    chosen side (the root's file system, or its parent's directory) look names up ignoring case."""
    real_stat, real_lstat = os.stat, os.lstat
    top = str(root)

    def inside(path: str) -> bool:
        return path == top or path.startswith(top + os.sep)

    def folds(directory: str) -> bool:
        return root_folds if inside(directory) else parent_folds and directory == str(root.parent)

    def faked(real: Any) -> Any:
        def look(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            path = os.fspath(path)
            try:
                found = real(path, *args, **kwargs)
            except FileNotFoundError:
                directory, name = os.path.split(path)
                match = (
                    next((n for n in os.listdir(directory) if n.lower() == name.lower()), None)
                    if folds(directory)
                    else None
                )
                if match is None:
                    raise
                path = os.path.join(directory, match)  # the entry found, whichever spelling found it
                found = real(path, *args, **kwargs)
            if inside(path):
                return os.stat_result((*found[:2], found.st_dev + 1, *found[3:10]))
            return found

        return look

    patch.setattr(os, "stat", faked(real_stat))
    patch.setattr(os, "lstat", faked(real_lstat))


@pytest.mark.parametrize(("root_folds", "parent_folds"), [(True, False), (False, True)])
def test_an_empty_root_on_its_own_file_system_is_probed_there_not_in_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root_folds: bool, parent_folds: bool
) -> None:
    """An empty root has no name to probe, and its parent may be another file system (the root is
    a mount point): the probe is a file made (and removed) in the root itself."""
    from dsh_plugins import guards

    root = tmp_path / "mnt"
    root.mkdir()
    with monkeypatch.context() as patch:
        _mount(patch, root, root_folds=root_folds, parent_folds=parent_folds)
        assert guards._case_insensitive(str(root)) is root_folds
    assert list(root.iterdir()) == []  # the probe file is gone


def test_an_undecidable_root_folds_case_the_safe_way_for_deny_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty root on its own file system that cannot be written to: nothing can say how it looks
    names up, so deny globs fold case (".ENV" is denied with .env whether or not it is the same file)."""
    from dsh_plugins import guards

    root = tmp_path / "mnt"
    root.mkdir()

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(root))

    with monkeypatch.context() as patch:
        _mount(patch, root, root_folds=False, parent_folds=False)
        patch.setattr(tempfile, "mkstemp", read_only)
        assert guards._case_insensitive(str(root)) is True


async def test_a_path_no_file_can_have_is_denied_with_a_reason_not_a_traceback(
    boot: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone surrogate outside surrogateescape's range has no bytes: realpath raised UnicodeEncodeError."""
    (tmp_path / "caf\udce9.txt").write_bytes(b"latin-1 name\n")  # surrogateescape: a real file name
    async with boot(*rows(tmp_path, deny_paths=["**/.env"])) as h:
        result = await h.call("read", {"path": "a\ud800b"})
        assert result.code == "DENIED"
        assert result.error is not None and result.error.message == (
            'guards: path "a\\ud800b" (argument "path") cannot be a file name: it holds a lone surrogate '
            "(\\ud800) that has no encoding"
        )
        assert "Traceback" not in caplog.text and "UnicodeEncodeError" not in caplog.text
        assert (await h.call("read", {"path": "caf\udce9.txt"})).error is None


async def test_path_arguments_the_guard_cannot_read_are_denied_not_passed(boot: Any, tmp_path: Path) -> None:
    """A loosely typed tool may take a path as "", a number (a descriptor to open()), an object, a nested list,
    or under a path key inside another argument: with path rules set, each is judged or denied, never passed."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x\n")
    ran: list[object] = []

    async def run(args: Any, ctx: Any) -> Any:
        ran.append(args)
        return "ran"

    loose = define_tool(name="loose", description="takes anything", execute=run, parameters={"type": "object"})
    async with boot(*rows(tmp_path, allowed_roots=["src"])) as h:
        h.registry.register(loose)
        for arguments in (
            {"path": ""},
            {"path": 3},
            {"path": None},
            {"path": True},
            {"path": {"p": "src"}},
            {"path": [["docs.txt"]]},
            {"paths": ["src/a.py", 0]},
            {"files": [{"path": "docs.txt"}]},
            {"options": {"nested": {"dir": ".."}}},
        ):
            result = await h.call("loose", arguments)
            assert result.code == "DENIED", arguments
            assert 'plugin row "guards"' in result.text, arguments
        assert ran == []
        denied = await h.call("loose", {"path": 3})
        assert denied.error is not None and denied.error.message == (
            'guards: argument "path" is a number, not a path (a string or a list of strings), so '
            'deny_paths and allowed_roots of plugin row "guards" cannot judge it; denied'
        )
        for arguments in (
            {"path": "src/a.py"},
            {"files": [{"path": "src/a.py"}], "count": 3},
            {"paths": ["src", "src/a.py"]},
        ):
            assert (await h.call("loose", arguments)).error is None, arguments
    async with boot(*rows(tmp_path)) as h:  # no path rules: the guard judges nothing
        h.registry.register(loose)
        assert (await h.call("loose", {"path": 3, "files": [{"path": None}]})).error is None


async def test_an_omitted_path_argument_is_judged_as_the_tools_default(boot: Any, tmp_path: Path) -> None:
    """list and search without a path work on the root: allowed_roots must judge that, not let it through."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x\n")
    (tmp_path / "docs.txt").write_text("SECRET=1\n")
    ran: list[object] = []

    async def run(args: Any, ctx: Any) -> Any:
        ran.append(args)
        return "ran"

    async with boot(*rows(tmp_path, allowed_roots=["src"])) as h:
        for name, arguments in (("list", {}), ("search", {"pattern": "SECRET"})):
            result = await h.call(name, arguments)
            assert result.code == "DENIED", name
            assert result.error is not None and result.error.message.startswith(
                'guards: path "." (argument "path", omitted: judged as the tool\'s default) resolves to '
                f"{tmp_path.resolve()}, outside the allowed roots"
            ), result.error.message
        assert (await h.call("search", {"pattern": "x", "path": "src"})).error is None
        # A default the tool's schema declares is the one judged.
        h.registry.register(
            define_tool(
                name="lint",
                description="d",
                execute=run,
                parameters={
                    "type": "object",
                    "properties": {"dir": {"type": "string", "default": "src"}, "file": {"type": "string"}},
                },
            )
        )
        assert (await h.call("lint", {"file": "src/a.py"})).error is None
        assert (await h.call("lint", {"dir": "src"})).code == "DENIED"  # "file" omitted: the root
        assert ran == [{"file": "src/a.py"}]
    async with boot(*rows(tmp_path, deny_paths=["**/.env"])) as h:  # the root itself is not denied here
        assert (await h.call("list", {})).error is None


async def test_a_relative_glob_through_a_symlink_denies_the_files_it_leads_to(boot: Any, tmp_path: Path) -> None:
    """ "alias/**" with alias -> secrets denied alias/key but not secrets/key, the same file, though the absolute
    spelling of the same glob denied both: relative globs resolve their leading symlinks too."""
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "key").write_text("k\n")
    (tmp_path / "notes.txt").write_text("ok\n")
    (tmp_path / "alias").symlink_to("secrets")
    async with boot(*rows(tmp_path, deny_paths=["alias/"])) as h:
        for path in ("secrets/key", "alias/key", "secrets", str(tmp_path / "secrets/key")):
            result = await h.call("read", {"path": path})
            assert result.code == "DENIED" and 'matches the denied pattern "alias/"' in result.text, path
        assert (await h.call("read", {"path": "notes.txt"})).error is None
    for deny in ("alias/**", "./alias/[k]ey"):
        verdicts = await guard_verdicts({"root": str(tmp_path), "deny_paths": [deny]}, "secrets/key", "notes.txt")
        assert f'matches the denied pattern "{deny}"' in str(verdicts[0]) and verdicts[1] is None, deny


async def test_bracket_classes_mean_what_fnmatch_means_and_bad_ones_are_named(boot: Any, tmp_path: Path) -> None:
    """A "]" first in a class is a member, a backslash is a member in "[!...]" too, "a[]b" is literal: such
    globs crashed the load ("bad escape \\Z") or meant a regex class; one no regex holds names its pattern."""
    verdicts = await guard_verdicts(
        {"root": str(tmp_path), "deny_paths": ["a[]b", "x[]]", "y[!\\w]", "k[!]]"]},
        "a[]b",
        "x]",
        "yx",
        "kx",
        "y\\",
        "yw",
        "k]",
        "ab",
    )
    assert [verdict is not None for verdict in verdicts] == [True, True, True, True, False, False, False, False]
    with pytest.raises(
        Exception,
        match=re.escape(
            'deny_paths pattern "file[z-a]" of plugin row "guards" is not a valid glob: bad character range z-a'
        ),
    ):
        async with boot(*rows(tmp_path, deny_paths=["file[z-a]"])):
            pass  # pragma: no cover


def tree_with_secrets(root: Path) -> None:
    """A workspace holding secrets a search of the root would reach, beside files it may show."""
    (root / ".env").write_text("SECRET=top\n")
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "sub" / "deep" / ".env").write_text("SECRET=deep\n")
    (root / "sub" / "SECRET.md").write_text("no secret here\n")
    (root / "secrets").mkdir()
    (root / "secrets" / "key").write_text("SECRET=key\n")
    (root / "secrets" / "more").write_text("SECRET=more\n")
    (root / "build").mkdir()  # "build" alone is denied as itself, not what lies under it
    (root / "build" / "out.txt").write_text("SECRET mentioned in a log\n")
    (root / "notes.txt").write_text("the SECRET is elsewhere\n")
    (root / "alias").symlink_to(".env")  # named, "alias" is denied: it opens .env


SECRET_RULES = ["**/.env", "secrets/", "build"]


@pytest.mark.parametrize("guards_first", [False, True])
async def test_search_and_list_withhold_what_the_path_guard_denies(
    boot: Any, tmp_path: Path, guards_first: bool
) -> None:
    """search and list on a parent directory reach no file the guard would deny if a call named it, and say
    how many entries they withheld (without naming them); the rows may load in either order."""
    tree_with_secrets(tmp_path)
    workspace, bash, guards = rows(tmp_path, deny_paths=SECRET_RULES)
    async with boot(*([guards, workspace, bash] if guards_first else [workspace, bash, guards])) as h:
        for path in (".env", "sub/deep/.env", "secrets/key", "alias", "build"):  # what the guard denies by name
            assert (await h.call("read" if path != "build" else "list", {"path": path})).code == "DENIED", path
        found = await h.call("search", {"pattern": "SECRET"})
        assert found.error is None
        assert sorted((m["path"], m["text"]) for m in found.value["matches"]) == [
            ("build/out.txt", "SECRET mentioned in a log"),
            ("notes.txt", "the SECRET is elsewhere"),
        ]
        # .env, sub/deep/.env and the directory secrets (not walked: all under it is denied).
        assert found.value["withheld"] == 3
        assert "[3 entries withheld by the path guard: not searched]" in found.text
        assert ".env" not in found.text and "secrets" not in found.text
        sub = await h.call("search", {"pattern": "SECRET", "path": "sub"})
        assert [m["path"] for m in sub.value["matches"]] == [] and sub.value["withheld"] == 1
        inside = await h.call("search", {"pattern": "SECRET", "path": "secrets"})  # "secrets" names the directory
        assert inside.code == "DENIED"
        listed = await h.call("list", {})
        assert [e["name"] for e in listed.value["entries"]] == ["notes.txt", "sub"]
        assert listed.value["withheld"] == 4  # .env, alias (it leads to .env), build, secrets
        assert listed.text == "notes.txt\nsub/\n[4 entries withheld by the path guard]"
        deep = await h.call("list", {"path": "sub/deep"})
        assert deep.value["entries"] == [] and deep.value["withheld"] == 1
        assert deep.text == "[1 entry withheld by the path guard]"
    async with boot(*rows(tmp_path)) as h:  # no path rules: search and list see everything, as before
        found = await h.call("search", {"pattern": "SECRET"})
        assert len(found.value["matches"]) == 6 and found.value["withheld"] == 0
        listed = await h.call("list", {})
        assert [e["name"] for e in listed.value["entries"]] == [".env", "alias", "build", "notes.txt", "secrets", "sub"]
        assert listed.value["withheld"] == 0 and "withheld" not in listed.text


async def test_list_and_search_withhold_what_lies_outside_the_allowed_roots(boot: Any, tmp_path: Path) -> None:
    """A symlink listed in an allowed directory that leads out of every allowed root is withheld, as naming it
    would be denied; search never follows it."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("TOKEN = 1\n")
    (tmp_path / "docs.txt").write_text("TOKEN = 2\n")
    (tmp_path / "src" / "docs").symlink_to(tmp_path / "docs.txt")
    async with boot(*rows(tmp_path, allowed_roots=["src"])) as h:
        listed = await h.call("list", {"path": "src"})
        assert [e["name"] for e in listed.value["entries"]] == ["a.py"] and listed.value["withheld"] == 1
        found = await h.call("search", {"pattern": "TOKEN", "path": "src"})
        assert [m["path"] for m in found.value["matches"]] == ["src/a.py"]


async def test_the_search_worker_never_opens_a_withheld_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Denied files are judged before they are read, and a directory all of whose contents are denied is not
    walked: the worker is handed the guard's rules, not asked to filter what it already read."""
    from dsh_plugins import _search_worker
    from dsh_plugins._path_rules import SERVICE
    from dsh_plugins.workspace import WorkspaceTools

    tree_with_secrets(tmp_path)
    loaded = await load_plugin("guards", {"root": str(tmp_path), "deny_paths": SECRET_RULES})
    try:
        published = loaded.root.lookup(SERVICE)
        assert published is not None
        request = WorkspaceTools({"root": str(tmp_path)})._search_request("SECRET", ".", published.snapshot())
    finally:
        await loaded.dispose()
    opened: list[str] = []
    walked: list[str] = []
    read_regular, walk = _search_worker._read_regular, _search_worker._walk

    def recording_read(name: str, dir_fd: int, max_bytes: int) -> bytes | None:
        opened.append(name)
        return read_regular(name, dir_fd, max_bytes)

    def recording_walk(*args: Any, **kwargs: Any) -> Any:
        for step in walk(*args, **kwargs):
            walked.append(step[0])
            yield step

    monkeypatch.setattr(_search_worker, "_read_regular", recording_read)
    monkeypatch.setattr(_search_worker, "_walk", recording_walk)
    events: list[dict[str, Any]] = []
    try:
        _search_worker.search(request, events.append)
    finally:
        monkeypatch.undo()
        os.close(request["fd"])
    assert sorted(opened) == ["SECRET.md", "alias", "notes.txt", "out.txt"]  # alias: a symlink, skipped unread
    assert sorted(walked) == [".", "./build", "./sub", "./sub/deep"]
    assert sorted(e["match"]["path"] for e in events if "match" in e) == ["build/out.txt", "notes.txt"]
    assert events.count({"file": "withheld"}) == 3


async def test_published_rules_close_only_directories_all_under_which_is_denied(tmp_path: Path) -> None:
    """A walk may skip a directory only when every path under it is denied ("x/", "x/**", "**/.git/**", an
    absolute "/.../x/"); "x" alone or "x/*" leave something under x allowed, so it is walked and judged by file.
    The rules are withdrawn with the row."""
    from dsh_plugins._path_rules import SERVICE

    (tmp_path / "link").symlink_to(tmp_path / "vault")
    deny = ["secrets/", "cache/**", "**/.git/**", f"{tmp_path}/link/", "build", "logs/*"]
    loaded = await load_plugin("guards", {"root": str(tmp_path), "deny_paths": deny})
    published = loaded.root.lookup(SERVICE)
    (rules,) = published.snapshot()
    closed = {
        name: rules.closes(str(tmp_path / name))
        for name in ("secrets", "cache", "a/b/.git", "vault", "link", "build", "logs", "src", "secretsx")
    }
    assert closed == {
        "secrets": True,
        "cache": True,
        "a/b/.git": True,
        "vault": True,
        "link": True,
        "build": False,
        "logs": False,
        "src": False,
        "secretsx": False,
    }
    assert rules.closes(str(tmp_path.parent))  # outside the root, relative globs cannot judge: fail closed
    assert rules.judge_found(str(tmp_path / "logs" / "a")) is not None
    assert rules.judge_found(str(tmp_path / "logs" / "a" / "b")) is None
    await loaded.dispose()
    assert published.snapshot() == ()


async def test_list_and_search_judge_entries_as_the_root_as_configured_spells_them(boot: Any, tmp_path: Path) -> None:
    """With the root configured through a symlink (/tmp on macOS), a call naming ".env" is judged under that
    spelling too, so an absolute glob whose globbed part spells the symlink denies it: list and search, which
    walk the real directory, must judge what they find under that spelling as well (files, directories closed
    by a "/**" glob, and symlinks)."""
    real, link = tmp_path / "real", tmp_path / "link"
    (real / "vault").mkdir(parents=True)
    (real / ".env").write_text("SECRET=1\n")
    (real / "vault" / "key").write_text("SECRET=2\n")
    (real / "ok.txt").write_text("SECRET=none\n")
    (real / "alias").symlink_to("ok.txt")  # judged where it stands too, not only where it leads
    link.symlink_to(real)
    deny = [f"{tmp_path}/l*nk/.env", f"{tmp_path}/l*nk/vault/", f"{tmp_path}/l*nk/alias"]
    async with boot(*rows(link, deny_paths=deny)) as h:
        for path in (".env", "vault/key", "alias"):
            assert (await h.call("read", {"path": path})).code == "DENIED", path
        found = await h.call("search", {"pattern": "SECRET"})
        assert [m["path"] for m in found.value["matches"]] == ["ok.txt"]
        assert found.value["withheld"] == 3  # .env, vault (closed), alias
        listed = await h.call("list", {})
        assert [e["name"] for e in listed.value["entries"]] == ["ok.txt"] and listed.value["withheld"] == 3


async def test_an_agent_scoped_guard_withholds_for_its_agent_only(tmp_path: Path) -> None:
    """A guards row started in one agent's scope judges that agent's calls only, so the rules it publishes
    must hold for what that agent's ``list`` and ``search`` reach (a deployment-level workspace row, which
    looks the rules up from its own scope, must still find them), and must not withhold anything from
    another agent, whose calls that guard never judges."""
    from dsh_core.config import compose
    from dsh_core.harness import Harness
    from dsh_core.plugins import PluginCatalog, start_plugin
    from dsh_plugins.guards import plugin as guards_factory

    (tmp_path / ".env").write_text("SECRET=1\n")
    (tmp_path / "notes.txt").write_text("SECRET=none\n")
    workspace = {"id": "workspace", "use": "workspace", "config": {"root": str(tmp_path)}}
    deployment_guard = {"id": "guards", "use": "guards", "config": {"root": str(tmp_path), "deny_paths": ["*.key"]}}
    for plugin_rows in ([workspace], [workspace, deployment_guard]):
        deployment = compose([("test", {"plugins": plugin_rows, "agents": [{"id": "a"}, {"id": "b"}]})], env={})
        h = await Harness.start(deployment, catalog=PluginCatalog(strict=True))
        try:
            await start_plugin(
                plugin_id="guards-a",
                factory=guards_factory,
                parent=h.agent("a"),
                hooks=h.hooks,
                config={"root": str(tmp_path), "deny_paths": ["**/.env"]},
                registrars={},
            )
            assert (await h.call("read", {"path": ".env"}, agent="a")).code == "DENIED"
            found = await h.call("search", {"pattern": "SECRET"}, agent="a")
            assert [m["path"] for m in found.value["matches"]] == ["notes.txt"], plugin_rows
            listed = await h.call("list", {}, agent="a")
            assert [e["name"] for e in listed.value["entries"]] == ["notes.txt"], plugin_rows
            assert (await h.call("read", {"path": ".env"}, agent="b")).error is None
            found = await h.call("search", {"pattern": "SECRET"}, agent="b")
            assert [m["path"] for m in found.value["matches"]] == [".env", "notes.txt"], plugin_rows
            listed = await h.call("list", {}, agent="b")
            assert [e["name"] for e in listed.value["entries"]] == [".env", "notes.txt"], plugin_rows
        finally:
            await h.aclose()


async def test_brace_alternatives_deny_each_alternative_as_bash_expands_them(boot: Any, tmp_path: Path) -> None:
    """ "**/*.{pem,key}" matched only a file literally named "x.{pem,key}": a deny rule that silently denied
    nothing. Braces expand as bash expands them; a group without a comma, or inside a class, is literal."""
    verdicts = await guard_verdicts(
        {"root": str(tmp_path), "deny_paths": ["**/*.{pem,key}", "{build,dist/out}/", "a{b}", "c[{]d", "{x,y{1,2}}z"]},
        "certs/site.pem",
        "site.key",
        "notes.txt",
        "build/log",
        "dist/out/x",
        "dist/in/x",
        "a{b}",
        "ab",
        "c{d",
        "xz",
        "y1z",
        "y2z",
        "yz",
        "x.{pem,key}",
    )
    assert [verdict is not None for verdict in verdicts] == [
        True,
        True,
        False,
        True,
        True,
        False,
        True,
        False,
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    assert verdicts[0] is not None and 'the denied pattern "**/*.{pem,key}"' in verdicts[0]


@pytest.mark.parametrize("pattern", ["**/*.{pem,key", "x}{a,b", "{" * 12 + "a,b" + "}" * 12 + "{c,d}" * 11])
async def test_unbalanced_or_exploding_braces_are_refused_naming_the_pattern(
    boot: Any, tmp_path: Path, pattern: str
) -> None:
    with pytest.raises(Exception, match=re.escape(f'deny_paths pattern "{pattern}" of plugin row "guards"')):
        async with boot(*rows(tmp_path, deny_paths=[pattern])):
            pass  # pragma: no cover


async def test_tool_globs_expand_braces_and_one_no_tool_name_can_match_is_refused(boot: Any, tmp_path: Path) -> None:
    """deny_tools = ["{bash,write}"] denied nothing (fnmatch has no braces, and no tool name holds one), and
    neither did "mcp.exec" or "bash " (a tool name uses only A-Z, a-z, 0-9, "_" and "-"): silent no-ops."""
    async with boot(*rows(tmp_path, deny_tools=["{bash,wr[i]te}"])) as h:
        denied = await h.call("bash", {"command": "touch x"})
        assert denied.code == "DENIED" and 'deny_tools pattern "{bash,wr[i]te}"' in denied.text
        assert (await h.call("write", {"path": "y", "content": ""})).code == "DENIED"
        assert (await h.call("list", {})).error is None
    async with boot(*rows(tmp_path, allow_tools=["{read,list}"])) as h:
        assert (await h.call("list", {})).error is None
        assert (await h.call("bash", {"command": "touch x"})).code == "DENIED"
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    for key, pattern in (
        ("deny_tools", "mcp.exec"),
        ("deny_tools", "bash "),
        ("allow_tools", "read/*"),
        ("deny_tools", "{bash,exec"),
    ):
        with pytest.raises(Exception, match=re.escape(f'{key} pattern "{pattern}" of plugin row "guards"')):
            async with boot(*rows(tmp_path, **{key: [pattern]})):
                pass  # pragma: no cover


async def test_an_omitted_path_is_judged_by_the_definition_the_body_runs(boot: Any, tmp_path: Path) -> None:
    """The guard read the omitted path's default from the registry at its own stage: a shadow registered in
    the agent's layer before the guard, and gone before the body, had the guard judge the shadow's harmless
    default while the pinned tool's body then ran with its own default, a denied path."""
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "key").write_text("k\n")
    opened: list[str] = []

    def probe(default: str) -> Any:
        async def execute(args: Any, ctx: Any) -> Any:
            opened.append(args.get("path", default))
            return None

        return define_tool(
            name="probe",
            description="d",
            execute=execute,
            parameters={"type": "object", "properties": {"path": {"type": "string", "default": default}}},
        )

    async with boot(*rows(tmp_path, deny_paths=["secrets/"])) as h:
        agent = h.agent()
        h.registry.register(probe("secrets/key"))
        withdraw: list[Any] = []

        class Swapper:
            @hookimpl
            def dsh_pre_execute(self, execution: Any) -> None:
                if execution.name == "probe" and not withdraw:
                    withdraw.append(h.registry.register(probe("notes.txt"), scope=agent))

            @hookimpl
            def dsh_around_dispatch(self) -> Any:
                async def middleware(call: Any, proceed: Any) -> Any:
                    if withdraw:
                        withdraw.pop()()
                    return await proceed(call)

                return middleware

        h.hooks.register(Swapper(), name="swapper")
        result = await h.call("probe", {}, agent=agent)
    assert result.code == "DENIED", result.text
    assert opened == []
