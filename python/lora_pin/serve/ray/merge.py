"""The ingress's answers for reads about the whole deployment, merged from every replica's own answer.

``GET /v1/models``, ``/health`` and ``/metrics`` are asked of every replica (each answers with the single
server's app); these functions merge the answers, each given as ``{replica: (status, headers, body)}``:

- models: the union of the replicas' model cards. Every replica registers every adapter, so they agree;
  when they do not (a change that failed on one replica, a replica still converging), the list is the
  union and ``lora_pin_disagreement`` names, per model, the root each replica serves it from (None where
  it has none), instead of hiding the difference behind one replica's view;
- health: 200 while at least one replica is healthy (the deployment can answer), 503 when none is; the
  body says each replica's status, so a replica that is down is seen without taking the ingress out of a
  load balancer;
- metrics: every replica's series in one Prometheus text exposition, each sample labelled
  ``replica="<name>"``, each metric family's ``HELP`` and ``TYPE`` once.

When every replica gives the same status other than 200 (401 without the API key, say), that answer is
the answer, as it would be from one server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse, Response

__all__ = ["Answer", "merge_health", "merge_metrics", "merge_models"]

Answer = tuple[int, list[tuple[str, str]], bytes]
"""One replica's answer: status, headers as (name, value) pairs, body."""


def _common_refusal(answers: Mapping[str, Answer]) -> Response | None:
    statuses = {status for status, _, _ in answers.values()}
    if len(statuses) != 1 or 200 in statuses:
        return None
    status, headers, body = next(iter(answers.values()))
    return Response(body, status_code=status, media_type=dict(headers).get("content-type"))


def _unavailable(answers: Mapping[str, Answer], what: str) -> JSONResponse:
    per_replica = {name: status for name, (status, _, _) in sorted(answers.items())}
    message = f"no replica answered {what}: " + (
        ", ".join(f"{n} ({s})" for n, s in per_replica.items()) or "no replica is running"
    )
    error = {"message": message, "type": "ServiceUnavailable", "param": None, "code": 503}
    return JSONResponse({"error": error, "replicas": per_replica}, status_code=503)


def merge_models(answers: Mapping[str, Answer]) -> Response:
    """``GET /v1/models`` over every replica (see the module's docs): the replicas' cards in first-seen
    order, with ``lora_pin_disagreement`` when they differ; 503 when no replica answered 200."""
    refusal = _common_refusal(answers)
    if refusal is not None:
        return refusal
    lists = {}
    for name, (status, _, raw) in sorted(answers.items()):
        if status == 200:
            lists[name] = {card["id"]: card for card in json.loads(raw)["data"]}
    if not lists:
        return _unavailable(answers, "/v1/models")
    cards: dict[str, dict[str, Any]] = {}
    for served in lists.values():
        for model, card in served.items():
            cards.setdefault(model, card)
    disagreement = {}
    for model in cards:
        roots = {
            name: (served[model].get("root") if model in served else None) for name, served in lists.items()
        }
        if len(set(roots.values())) > 1:
            disagreement[model] = roots
    body: dict[str, Any] = {"object": "list", "data": list(cards.values())}
    if disagreement:
        body["lora_pin_disagreement"] = disagreement
    return JSONResponse(body)


def merge_health(answers: Mapping[str, Answer]) -> Response:
    """``GET /health`` over every replica: 200 with ``{"replicas": {name: status}}`` while at least one
    replica answers 200, else 503 naming each replica's status."""
    refusal = _common_refusal(answers)
    if refusal is not None and 503 not in {s for s, _, _ in answers.values()}:
        return refusal
    if not any(status == 200 for status, _, _ in answers.values()):
        return _unavailable(answers, "/health with 200")
    return JSONResponse({"replicas": {name: status for name, (status, _, _) in sorted(answers.items())}})


def _labelled(sample: str, replica: str) -> str:
    label = f'replica="{replica}"'
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = sample[brace + 1 :]
        return f"{sample[:brace]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


def merge_metrics(answers: Mapping[str, Answer]) -> Response:
    """``GET /metrics`` over every replica: one Prometheus text exposition (version 0.0.4) of every
    replica that answered 200, each sample labelled with its replica, each family's ``HELP`` and
    ``TYPE`` once (from the first replica that has it); 503 when no replica answered 200."""
    refusal = _common_refusal(answers)
    if refusal is not None:
        return refusal
    families: dict[str, tuple[list[str], list[str]]] = {}
    for name, (status, _, body) in sorted(answers.items()):
        if status != 200:
            continue
        family = ""
        for line in body.decode("utf-8", "replace").splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(maxsplit=3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    head, _ = families.setdefault(family, ([], []))
                    if not any(h.split(maxsplit=3)[:3] == parts[:3] for h in head):
                        head.append(line)
                continue
            families.setdefault(family, ([], []))[1].append(_labelled(line, name))
    if not families and not any(status == 200 for status, _, _ in answers.values()):
        return _unavailable(answers, "/metrics")
    lines = [line for head, samples in families.values() for line in (*head, *samples)]
    text = "\n".join(lines) + "\n"
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
