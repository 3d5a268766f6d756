"""The one reader of secret files: stripped text, or one line naming the file and setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from controllerd.adapters.secrets import read_secret
from controllerd.errors import EXIT_USAGE, OperatorError


def test_a_secret_is_the_files_text_without_surrounding_whitespace(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("  s3cret\n", encoding="utf-8")
    assert read_secret(str(secret), "broker.token_file") == "s3cret"
    assert read_secret(None, "broker.token_file") is None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read {secret}: "),
        (b"\xff\xfe not utf-8", "{secret} is not UTF-8 text"),
        (b" \n", "{secret} is empty"),
        (b"tok\nen\n", "{secret} must hold one line"),
    ],
)
def test_an_unusable_secret_is_one_line_naming_the_file_and_setting(
    tmp_path: Path, content: bytes | None, problem: str
) -> None:
    """A two-line token used to pass the checks and fail later, in the HTTP client."""
    secret = tmp_path / "password"
    if content is not None:
        secret.write_bytes(content)
    with pytest.raises(OperatorError) as caught:
        read_secret(str(secret), "etcd.password_file")
    assert caught.value.exit_code == EXIT_USAGE
    line = caught.value.line()
    assert line.startswith(problem.format(secret=secret))
    assert line.endswith("(setting: etcd.password_file)")
