"""The repository's commit-msg hook (.githooks/commit-msg, docs/development/contributing.md) refuses a subject over
72 characters, a message without a blank second line or without a body, and passes a good message."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[2] / ".githooks" / "commit-msg"
BODY = "\n\nWhy: the reason the change is made.\n"
SUBJECT_72 = "A subject of exactly seventy-two characters, which is the most allowed!!"


def run_hook(tmp_path: Path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([str(HOOK), str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("message", [
    SUBJECT_72 + BODY,
    "Short subject" + BODY + "# Please enter the commit message for your changes.\n",
    "Merge branch 'x' into main\n",  # git's own subjects pass
    "Revert \"Something\"\n\nThis reverts commit abc.\n",
], ids=["72-characters", "git-comments-ignored", "merge", "revert"])
def test_the_hook_passes_a_good_message(tmp_path, message):
    assert len(SUBJECT_72) == 72
    result = run_hook(tmp_path, message)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("message", "says"), [
    (SUBJECT_72 + "!" + BODY, "73 characters"),
    ("A subject with no body\n", "no body"),
    ("A subject\n\n   \n# only a comment\n", "no body"),
    ("A subject\nglued to its body\n", "second line must be blank"),
    ("\n\nbody only\n", "subject line is empty"),
], ids=["73-characters", "no-body", "blank-body", "no-blank-line", "no-subject"])
def test_the_hook_refuses_a_bad_message_saying_why(tmp_path, message, says):
    result = run_hook(tmp_path, message)
    assert result.returncode == 1 and says in result.stderr, result.stderr
