"""The scripted provider: replay, expect guards, divergence and exhaustion, script checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsh_core.agent.provider import ProviderError
from dsh_core.scope import Scope
from dsh_plugins.providers.scripted import NO_MODEL_NOTICE, ScriptedProvider, load_script, plugin

pytestmark = pytest.mark.anyio

TOOLS = [{"name": "add", "description": "Add.", "parameters": {"type": "object"}}]


def script(tmp_path: Path, *lines: Any) -> Path:
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


CALL_TURN = {
    "expect": {"last_role": "user", "tools_include": ["add"], "model": "m"},
    "role": "assistant",
    "content": None,
    "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}],
}
FINAL_TURN = {"expect": {"last_role": "tool", "last_content_contains": "2"}, "role": "assistant", "content": "two"}


async def test_turns_replay_in_order_and_expectations_are_checked(tmp_path: Path) -> None:
    provider = ScriptedProvider.from_file(script(tmp_path, CALL_TURN, "", FINAL_TURN))
    user = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1"}]
    first = await provider.complete(user, TOOLS, model="m")
    assert first == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
    }
    seen: list[str] = []

    async def on_text(text: str) -> None:
        seen.append(text)

    history = [*user, first, {"role": "tool", "tool_call_id": "call_1_1", "content": "2"}]
    assert (await provider.complete(history, TOOLS, on_text=on_text))["content"] == "two"
    assert seen == ["two"]
    assert [r["model"] for r in provider.requests] == ["m", None]


async def test_divergence_and_exhaustion_fail_naming_the_line(tmp_path: Path) -> None:
    path = script(tmp_path, CALL_TURN, FINAL_TURN)
    provider = ScriptedProvider.from_file(path)
    with pytest.raises(
        ProviderError,
        match=r"s\.jsonl:1: expect failed at assistant turn 1: tools_include: add "
        r"not offered \(offered: none\)",
    ):
        await provider.complete([{"role": "user", "content": "x"}], [], model="m")
    with pytest.raises(ProviderError, match="model 'm' expected, the agent asked for 'other'"):
        await provider.complete([{"role": "user", "content": "x"}], TOOLS, model="other")
    wrong = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "improvised"},
        {"role": "tool", "content": "2"},
    ]
    with pytest.raises(ProviderError) as caught:
        await provider.complete(wrong, TOOLS)
    assert caught.value.kind == "script-diverged"
    assert (
        "s.jsonl:1: the conversation diverged from the script at assistant turn 1: the history has text "
        "'improvised', the script has tool calls add" in caught.value.message
    )
    done = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "other-id", "type": "function", "function": {"name": "add", "arguments": '{ "a" : 1 }'}}
            ],
        },
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "?"},
    ]
    with pytest.raises(ProviderError) as exhausted:
        await provider.complete(done, TOOLS)
    assert exhausted.value.kind == "script-exhausted"
    assert (
        "script exhausted: the conversation asks for assistant turn 3, but the script has only 2 turn(s)"
        in exhausted.value.message
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "s.jsonl:1: not valid JSON"),
        ("[1]", "s.jsonl:1: each line must be a JSON object"),
        ({"role": "user", "content": "x"}, "s.jsonl:1: expected role 'assistant', got 'user'"),
        (
            {"content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
            "tool_calls[0].function.name is missing",
        ),
        ({"expect": {"last_role": 3}, "content": "x"}, "s.jsonl:1: expect.last_role must be a string"),
        ({"expect": {"tools_include": "add"}, "content": "x"}, "expect.tools_include must be a list of strings"),
    ],
)
def test_invalid_scripts_are_refused_at_load(tmp_path: Path, line: Any, message: str) -> None:
    with pytest.raises(ProviderError) as caught:
        load_script(script(tmp_path, line))
    assert caught.value.kind == "script-invalid" and message in caught.value.message


@pytest.mark.parametrize(
    ("line", "message"),
    [
        # Python's json accepts these; a session event cannot carry them, so the run would fail when recording.
        ('{"content": "x", "_meta": {"usage": {"cost": NaN}}}', "s.jsonl:2: not valid JSON: NaN is not valid JSON"),
        (
            '{"content": null, "tool_calls": [{"function": {"name": "add", "arguments": {"a": -Infinity}}}]}',
            "s.jsonl:2: not valid JSON: -Infinity is not valid JSON",
        ),
        (
            '{"content": "x", "_meta": {"usage": {"cost": 1e400}}}',
            "s.jsonl:2: not lossless JSON at /_meta/usage/cost: float inf is not finite",
        ),
        (
            '{"content": "x", "_meta": {"usage": {"cost": -0.0}}}',
            "s.jsonl:2: not lossless JSON at /_meta/usage/cost: float -0.0 does not survive JSON",
        ),
        (
            '{"content": "x", "_meta": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "s.jsonl:2: not valid JSON: nested too deeply",
        ),
    ],
)
def test_numbers_json_cannot_carry_are_refused_at_load_naming_the_line(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ProviderError) as caught:
        load_script(script(tmp_path, FINAL_TURN, line))
    assert caught.value.kind == "script-invalid"
    assert caught.value.message.startswith(f"{tmp_path / message}"), caught.value.message


def test_missing_and_empty_scripts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ProviderError, match="cannot read script"):
        load_script(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ProviderError, match="the script has no turns"):
        load_script(tmp_path / "empty.jsonl")


async def test_without_a_script_it_says_no_model_is_configured() -> None:
    instance = plugin(Scope("p"), {})
    assert instance.name == "scripted"
    reply = await instance.provider.complete([{"role": "user", "content": "hi"}], [])
    assert reply == {"role": "assistant", "content": NO_MODEL_NOTICE}
    assert "DSH_BASE_URL, DSH_MODEL and DSH_API_KEY" in NO_MODEL_NOTICE


def test_the_notice_says_when_half_an_endpoint_is_set() -> None:
    from dsh_plugins.providers.scripted import no_model_notice

    assert no_model_notice({}) == NO_MODEL_NOTICE
    assert no_model_notice({"DSH_BASE_URL": "http://x", "DSH_MODEL": "m"}) == NO_MODEL_NOTICE
    assert no_model_notice({"DSH_MODEL": "m"}).endswith(
        "(DSH_MODEL is set but DSH_BASE_URL is not: dsh never guesses the endpoint.)"
    )
    assert "(DSH_MODEL and DSH_API_KEY are set but DSH_BASE_URL is not" in no_model_notice(
        {"DSH_MODEL": "m", "DSH_API_KEY": "k"}
    )


async def test_a_relative_script_is_read_from_the_directory_of_the_config_file_that_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A deployment file /etc/x/dsh.toml saying script = "demo.jsonl" must work from any directory,
    # as paths in tox's and pytest's config files do; an overlay's own relative path is read from its directory.
    from dsh_core.config import load_deployment
    from dsh_core.harness import Harness

    base, overlay = tmp_path / "etc" / "x", tmp_path / "site"
    base.mkdir(parents=True)
    overlay.mkdir()
    script(base, FINAL_TURN).rename(base / "demo.jsonl")
    script(overlay, CALL_TURN).rename(overlay / "other.jsonl")
    (base / "dsh.toml").write_text(
        '[[plugins]]\nid = "scripted"\nuse = "scripted"\nconfig = { script = "demo.jsonl" }\n'
    )
    (overlay / "dsh.toml").write_text('[[plugins]]\nid = "scripted"\nconfig = { script = "other.jsonl" }\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    files = [Path("etc/x/dsh.toml"), Path("site/dsh.toml")]  # relative to the directory dsh started in
    deployment = load_deployment(files[:1], env={})
    both = load_deployment(files, env={})
    monkeypatch.chdir(elsewhere)
    for loaded, expected in ((deployment, base / "demo.jsonl"), (both, overlay / "other.jsonl")):
        async with await Harness.start(loaded) as harness:
            provider = harness.providers.get("scripted")
            assert isinstance(provider, ScriptedProvider)
            assert provider.source == str(expected)


@pytest.mark.parametrize(
    ("env", "process_env", "says"),
    [
        ({"DSH_MODEL": "m", "DSH_API_KEY": "sk-secret"}, {}, "(DSH_MODEL and DSH_API_KEY are set but DSH_BASE_URL"),
        ({}, {"DSH_MODEL": "m"}, None),
    ],
)
async def test_the_no_model_notice_reads_the_env_the_default_deployment_was_built_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], process_env: dict[str, str], says: str | None
) -> None:
    # default_deployment(env=...) describes that environment; the notice used to read os.environ instead.
    from dsh_core.config import default_deployment, dump_text
    from dsh_core.harness import Harness

    for name in ("DSH_BASE_URL", "DSH_MODEL", "DSH_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in process_env.items():
        monkeypatch.setenv(name, value)
    deployment = default_deployment(tmp_path, env=env)
    assert "sk-secret" not in dump_text(deployment)  # only names reach the config, never a key
    async with await Harness.start(deployment) as harness:
        provider = harness.providers.get("scripted")
        reply = await provider.complete([{"role": "user", "content": "hi"}], [])
    if says is None:
        assert reply["content"] == NO_MODEL_NOTICE
    else:
        assert reply["content"].startswith(NO_MODEL_NOTICE) and says in reply["content"]
