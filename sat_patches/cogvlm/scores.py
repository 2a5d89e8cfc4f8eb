"""Scores of an evaluation by generation and its ``summary.json``, without torch or SAT: the finetune scripts'
runner prints them after a run without starting either (about 10 s on a CPU machine)."""
from __future__ import annotations

import json
import os
from typing import Dict, List


def char_score(prediction: str, answer: str) -> float:
    """Share of positions where ``prediction`` and ``answer`` hold the same character, over the longer one."""
    longest = max(len(prediction), len(answer))
    return 1.0 if longest == 0 else sum(p == a for p, a in zip(prediction, answer)) / longest


def summarise(rows: List[Dict]) -> Dict:
    n = len(rows)
    exact = sum(row["exact"] for row in rows)
    return {"samples": n, "exact_match": exact, "accuracy": exact / n if n else 0.0,
            "char_accuracy": sum(char_score(r["prediction"], r["answer"]) for r in rows) / n if n else 0.0}


def read_summary(out: str) -> Dict:
    """The ``summary.json`` an evaluation wrote into ``out``."""
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def summary_line(summary: Dict, data: str, label: str = "evaluation") -> str:
    return (f"{label}: exact match {summary['exact_match']}/{summary['samples']} ({summary['accuracy']:.1%}), "
            f"characters {summary['char_accuracy']:.1%} on {data}")
