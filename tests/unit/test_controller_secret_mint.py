"""A secret is minted only when it is created: the decisions carry no password (a pass is a pure function of its
inputs), the Secret's Create names the key to mint (actions.Create.mint), and the loop's applier mints the managed
Redis password for that one Create. Passes over a job whose Secret exists mint nothing."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from rlkube.controller.reconcile import loop as loop_mod
from rlkube.controller.manifests import names
from rlkube.controller.decisions.actions import Create
from rlkube.controller.reconcile.loop import JobLoop, Shared
from test_controller_decisions import T0, all_pods, job, run


class _Creates:
    """Records what the applier creates (the API server's side is tested by the operator tests)."""

    def __init__(self) -> None:
        self.created: list[dict] = []

    async def create(self, namespace: str, manifest: dict) -> None:
        self.created.append(manifest)


def _apply(decisions, monkeypatch) -> tuple[list[dict], list[str]]:
    """Apply the decisions' actions as the job loop does; what was created and which values were minted."""
    kube = _Creates()
    minted: list[str] = []

    def token(n: int) -> str:
        minted.append(f"minted-{len(minted)}-{n}")
        return minted[-1]

    monkeypatch.setattr(loop_mod.secrets, "token_urlsafe", token)
    loop = JobLoop(Shared(kube=kube), "ns", "j")
    for d in decisions:
        asyncio.run(loop._apply(None, d))
    return kube.created, minted


def _secret_creates(decision) -> list[Create]:
    return [a for a in decision.actions if isinstance(a, Create) and a.kind == "Secret"]


def test_the_first_pass_creates_the_secret_without_a_password_and_the_applier_mints_it_once(monkeypatch):
    first = run(job(), static=())
    (secret,) = _secret_creates(first)
    assert secret.mint == names.SECRET_KEY and "stringData" not in secret.manifest
    assert [a for a in first.actions if isinstance(a, Create) and a.mint is not None] == [secret]
    # Pure: the same inputs give the same decision (no password, nothing random in it).
    assert run(job(), static=()) == first

    created, minted = _apply([first], monkeypatch)
    (made,) = [m for m in created if m["kind"] == "Secret"]
    assert minted == ["minted-0-24"] and made["stringData"] == {names.SECRET_KEY: "minted-0-24"}
    assert "stringData" not in secret.manifest  # the decision's manifest is left as it was


def test_two_passes_over_an_existing_job_mint_nothing(monkeypatch):
    starting = run(job(), all_pods(), now=T0 - timedelta(minutes=2))
    running = run(job(starting.status), all_pods(), now=T0 - timedelta(minutes=1))
    again = run(job(running.status), all_pods(), now=T0)
    assert not _secret_creates(running) and not _secret_creates(again)
    created, minted = _apply([running, again], monkeypatch)
    assert minted == [] and not [m for m in created if m["kind"] == "Secret"]


def test_a_secret_deleted_by_hand_is_recreated_with_a_fresh_password(monkeypatch):
    status = run(job(), all_pods(), now=T0 - timedelta(minutes=1)).status
    present = {"ConfigMap/j-config", "NetworkPolicy/j-redis", "Service/j-redis", "Service/j-inference",
               "Service/j-trainer"}
    d = run(job(status), all_pods(), static=present)
    assert [a.name for a in d.actions if isinstance(a, Create)] == ["j-redis"]
    created, minted = _apply([d], monkeypatch)
    assert len(minted) == 1 and created[0]["stringData"] == {names.SECRET_KEY: minted[0]}


def test_create_minted_fills_only_the_named_key():
    manifest = {"kind": "Secret", "metadata": {"name": "s"}, "stringData": {"other": "x"}}
    assert Create(manifest).minted("v") is manifest
    assert Create(manifest, mint="password").minted("v")["stringData"] == {"other": "x", "password": "v"}
    assert manifest["stringData"] == {"other": "x"}
