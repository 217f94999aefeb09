"""What a stored charge's event may be: one table of kinds, their fields and each field's range, read by the Python
check (every backend, before a charge is stored and when one is read) and compiled into the team ledger's
PostgreSQL check (``dptune_event_problem``, a trigger on ``charges``), so the two cannot drift.

A charge's event is the JSON :func:`dptune.accounting.event_to_json` writes. The ranges are those the accountant
needs: a count is an integer ≥ 1, a noise multiplier or Gumbel scale a finite number > 0, a probability or
subsampled fraction in (0, 1], a random-stopping mean finite > 0 and its shape ≥ 0 or ``"inf"`` (Poisson). A
kind outside the table, a missing or unknown field, or nesting deeper than :data:`MAX_DEPTH` is refused.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dp_accounting import dp_event as de

from dptune.accounting import event_from_json, event_to_json
from dptune.errors import ConfigError

__all__ = ["EVENT_RULES", "MAX_DEPTH", "UnreadableCharge", "event_problem", "event_text", "read_event", "validator_sql"]

MAX_DEPTH = 64  # nested events: dptune writes at most 6

# kind -> field -> rule: event (one nested event), events / events+ (a list of them, non-empty for +), count,
# positive, probability, shape (see the module docstring)
EVENT_RULES: dict[str, dict[str, str]] = {
    "NoOpDpEvent": {},
    "GaussianDpEvent": {"noise_multiplier": "positive"},
    "PoissonSampledDpEvent": {"sampling_probability": "probability", "event": "event"},
    "SelfComposedDpEvent": {"event": "event", "count": "count"},
    "ComposedDpEvent": {"events": "events"},
    "RepeatAndSelectDpEvent": {"event": "event", "mean": "positive", "shape": "shape"},
    "WorstCaseDpEvent": {"events": "events+"},
    "SubsampledMechanismDpEvent": {"event": "event", "fraction": "probability"},
    "NoisyMaxDpEvent": {"gumbel_scale": "positive"},
    "RdpFilterDpEvent": {"budget": "event"},
}

_NEEDS = {"count": "an integer >= 1", "positive": "a finite number > 0", "probability": "a number in (0, 1]",
          "shape": "a number >= 0 or \"inf\""}


class UnreadableCharge(ConfigError):
    """A stored charge whose event dptune cannot read: totals cannot be composed, so nothing is charged."""


def _number_ok(rule: str, v: Any) -> bool:
    if rule == "shape" and v == "inf":
        return True
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return False
    return {"count": v >= 1 and v == int(v), "positive": v > 0, "probability": 0 < v <= 1,
            "shape": v >= 0}[rule]


def event_problem(data: Any, depth: int = 0) -> str | None:
    """What is wrong with the event JSON ``data`` (parsed), or None: the one Python reading of :data:`EVENT_RULES`."""
    if depth > MAX_DEPTH:
        return f"events nested deeper than {MAX_DEPTH}"
    if not isinstance(data, dict):
        return f"an event is not a JSON object: {str(data)[:60]!r}"
    kind = data.get("type")
    rules = EVENT_RULES.get(kind) if isinstance(kind, str) else None
    if rules is None:
        return f"unknown kind of event {str(kind)[:60]!r}"
    for field in data:
        if field != "type" and field not in rules:
            return f"{kind} has no field {str(field)[:60]!r}"
    for field, rule in rules.items():
        if field not in data:
            return f"{kind} lacks its field {field!r}"
        v = data[field]
        if rule == "event":
            problem = event_problem(v, depth + 1)
        elif rule in ("events", "events+"):
            if not isinstance(v, list) or (rule == "events+" and not v):
                return f"{kind}.{field} is not a{' non-empty' if rule == 'events+' else ''} list of events"
            problem = next((p for p in (event_problem(x, depth + 1) for x in v) if p), None)
        else:
            problem = None if _number_ok(rule, v) else f"{kind}.{field} = {str(v)[:40]} is not {_NEEDS[rule]}"
        if problem:
            return problem
    return None


def event_text(event: de.DpEvent) -> str:
    """The JSON a charge stores for ``event``; a ConfigError if :data:`EVENT_RULES` refuse it (as a team ledger's
    trigger would): nothing is charged."""
    text = json.dumps(event_to_json(event))
    problem = event_problem(json.loads(text))
    if problem:
        raise ConfigError("event", f"this charge's privacy event is malformed ({problem}): nothing was charged",
                          "a stopping rule or mechanism built an event the ledger cannot compose: fix its parameters")
    return text


def read_event(charge_id: int, text: str, *, where: str = "") -> de.DpEvent:
    """Charge ``charge_id``'s stored event, checked against :data:`EVENT_RULES`; an unreadable one is an
    :class:`UnreadableCharge` naming the charge, never a traceback from the accountant."""
    try:
        data = json.loads(text)
        problem = event_problem(data)
        if problem is None:
            return event_from_json(data)
    except (ValueError, TypeError, RecursionError) as e:
        problem = str(e)[:200]
    raise UnreadableCharge(
        "--ledger", f"charge #{charge_id}{' in ' + where if where else ''} holds an unreadable privacy event "
        f"({problem}): the spent ε of its budget cannot be composed, so nothing is charged to it",
        "it was written around dptune (a team ledger since schema 3 refuses such events); the ledger's owner "
        f"inspects charge #{charge_id} (`ledger history`), whose budget stays closed until it is resolved")


def validator_sql() -> str:
    """``dptune_event_problem(text)``, the PostgreSQL reading of :data:`EVENT_RULES` (NULL: a good event)."""
    return (_VALIDATOR.replace("@RULES@", json.dumps(EVENT_RULES).replace("'", "''"))
            .replace("@NEEDS@", json.dumps(_NEEDS).replace("'", "''")).replace("@DEPTH@", str(MAX_DEPTH)))


_VALIDATOR = """
CREATE OR REPLACE FUNCTION dptune_event_json_problem(e jsonb, depth integer) RETURNS text LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, @SCHEMA@, pg_temp AS $$
DECLARE
    rules jsonb := '@RULES@'::jsonb;
    needs jsonb := '@NEEDS@'::jsonb;
    kind text; field text; rule text; v jsonb; x numeric; ok boolean; problem text; item jsonb;
BEGIN
    IF depth > @DEPTH@ THEN RETURN 'events nested deeper than @DEPTH@'; END IF;
    IF jsonb_typeof(e) IS DISTINCT FROM 'object' THEN RETURN 'an event is not a JSON object'; END IF;
    kind := e ->> 'type';
    IF kind IS NULL OR rules -> kind IS NULL THEN RETURN format('unknown kind of event %s', kind); END IF;
    FOR field IN SELECT jsonb_object_keys(e) LOOP
        IF field <> 'type' AND rules -> kind -> field IS NULL THEN
            RETURN format('%s has no field %s', kind, field);
        END IF;
    END LOOP;
    FOR field, rule IN SELECT key, value FROM jsonb_each_text(rules -> kind) LOOP
        v := e -> field;
        IF v IS NULL THEN RETURN format('%s lacks its field %s', kind, field); END IF;
        IF rule = 'event' THEN
            problem := dptune_event_json_problem(v, depth + 1);
        ELSIF rule IN ('events', 'events+') THEN
            IF jsonb_typeof(v) <> 'array' OR (rule = 'events+' AND jsonb_array_length(v) = 0) THEN
                RETURN format('%s.%s is not a list of events', kind, field);
            END IF;
            FOR item IN SELECT value FROM jsonb_array_elements(v) LOOP
                problem := dptune_event_json_problem(item, depth + 1);
                EXIT WHEN problem IS NOT NULL;
            END LOOP;
        ELSIF rule = 'shape' AND v = '"inf"'::jsonb THEN
            problem := NULL;
        ELSIF jsonb_typeof(v) <> 'number' THEN
            problem := format('%s.%s = %s is not %s', kind, field, v, needs ->> rule);
        ELSE
            x := v::numeric;
            ok := CASE rule WHEN 'count' THEN x >= 1 AND x = trunc(x) WHEN 'positive' THEN x > 0
                  WHEN 'probability' THEN x > 0 AND x <= 1 WHEN 'shape' THEN x >= 0 ELSE false END;
            IF NOT ok THEN
                problem := format('%s.%s = %s is not %s', kind, field, v, needs ->> rule);
            END IF;
        END IF;
        IF problem IS NOT NULL THEN RETURN problem; END IF;
    END LOOP;
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION dptune_event_problem(event text) RETURNS text LANGUAGE plpgsql IMMUTABLE
    SET search_path = pg_catalog, @SCHEMA@, pg_temp AS $$
DECLARE parsed jsonb;
BEGIN
    BEGIN
        parsed := event::jsonb;
    EXCEPTION WHEN others THEN
        RETURN 'not JSON (NaN and Infinity are not numbers)';
    END;
    RETURN dptune_event_json_problem(parsed, 0);
END $$;
"""
