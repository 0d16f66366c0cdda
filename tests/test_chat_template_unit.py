"""--chat-template before the engine starts: a file or the template inline; a bad path names the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_a_template_file_or_inline(tmp_path: Path) -> None:
    from taco_llm.engine_worker.frontend.args import parse

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    for given in (str(path), TEMPLATE):
        args = parse(["--chat-template", given])
        assert args.frontend is not None and args.frontend.chat_template == TEMPLATE
    default = parse([])
    assert default.frontend is not None and default.frontend.chat_template is None
    assert not default.frontend.trust_request_chat_template
    assert parse(["--trust-request-chat-template"]).frontend.trust_request_chat_template  # type: ignore[union-attr]


def test_a_missing_template_file_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from taco_llm.engine_worker.frontend.args import parse

    missing = tmp_path / "missing.jinja"
    with pytest.raises(SystemExit) as caught:
        parse(["--chat-template", str(missing)])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"--chat-template {missing}:" in err and "failed to be opened" in err
