"""Fine-tuning records in JSON Lines: read, check, and turn into (image, history, query, answer) samples.

The format is the README's "Your own data": ``{"image", "prompt", "answer"}`` or ``{"image",
"conversations": [{"user", "assistant"}, ...]}`` (turn k asked with turns 1..k-1 as history), ``id`` optional.

Every record is checked when it is read (JSON, fields, the image decoded, non-empty answers, the boxes);
each problem is reported with ``file:line`` and what to change, then :func:`settle` applies
``SAT_PATCHES_BAD_RECORDS``. Needs neither torch nor SAT: the scripts' checks run it before any launch.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from PIL import Image

from ..core import settings

SETTING = "SAT_PATCHES_BAD_RECORDS"
MAX_SETTING = "SAT_PATCHES_BAD_RECORDS_MAX"
BOX = re.compile(r"\[\[(.*?)\]\]")
SHOWN = 10  # problems listed in a message


class DataError(ValueError):
    """The data cannot be used as it is: the message names each problem's file and line."""


class EmptyDatasetError(DataError):
    """No usable sample in the data."""


class DataWarning(UserWarning):
    """Records left out under ``SAT_PATCHES_BAD_RECORDS=skip`` (each named by ``file:line``)."""


@dataclass
class Sample:
    image: str                                  # absolute path
    query: str
    answer: str
    history: List[Tuple[str, str]] = field(default_factory=list)
    id: str = ""
    where: str = ""                             # file:line (turn t)


def box_problem(text: str) -> Optional[str]:
    """What is wrong with the ``[[...]]`` boxes in ``text``, or None."""
    for group in BOX.findall(text):
        for box in group.split(";"):
            parts = [p.strip() for p in box.split(",")]
            if len(parts) != 4 or not all(re.fullmatch(r"\d{1,3}", p) for p in parts):
                return (f"box [[{group}]] is not four whole numbers from 0 to 999 (x0,y0,x1,y1; several boxes "
                        f"separated by ';')")
            x0, y0, x1, y1 = map(int, parts)
            if x0 > x1 or y0 > y1:
                return f"box [[{group}]] has x0 > x1 or y0 > y1: write the top-left corner first"
    return None


def image_problem(path: str) -> Optional[str]:
    """Why the image at ``path`` cannot be used (it is decoded whole), or None."""
    if not os.path.isfile(path):
        return "does not exist"
    try:
        with Image.open(path) as image:
            image.convert("RGB")  # decodes the whole file: truncated or corrupt files fail here
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ...
        return f"cannot be read ({type(exc).__name__}: {exc})"
    return None


def _turns(record: dict) -> Tuple[List[Tuple[str, str]], Optional[str]]:
    """(user, assistant) pairs of a record, or a problem."""
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            return [], "'conversations' must be a non-empty list of {\"user\": ..., \"assistant\": ...}"
        pairs = []
        for t, turn in enumerate(turns, 1):
            if not isinstance(turn, dict) or not isinstance(turn.get("user"), str) \
                    or not isinstance(turn.get("assistant"), str):
                return [], f"turn {t} must be {{\"user\": \"...\", \"assistant\": \"...\"}} (both strings)"
            pairs.append((turn["user"], turn["assistant"]))
        return pairs, None
    if not isinstance(record.get("prompt"), str) or not isinstance(record.get("answer"), str):
        return [], "give \"prompt\" and \"answer\" (strings), or \"conversations\" (a list of user/assistant turns)"
    return [(record["prompt"], record["answer"])], None


def _record_samples(record, folder: str, where: str) -> Tuple[List[Sample], Optional[str]]:
    if not isinstance(record, dict):
        return [], "a record must be a JSON object"
    image = record.get("image")
    if not isinstance(image, str) or not image:
        return [], "\"image\" (the path of the record's image) is missing"
    path = image if os.path.isabs(image) else os.path.normpath(os.path.join(folder, image))
    turns, problem = _turns(record)
    if problem:
        return [], problem
    for t, (query, answer) in enumerate(turns, 1):
        turn = f" (turn {t})" if len(turns) > 1 else ""
        if not answer.strip():
            return [], f"empty answer{turn}: give the text the model should learn to answer"
        problem = box_problem(query) or box_problem(answer)
        if problem:
            return [], problem + turn
    problem = image_problem(path)
    if problem:
        return [], f"image {path} {problem}: fix the path (relative to the JSONL file's folder) or remove the record"
    rid = str(record.get("id", os.path.splitext(os.path.basename(path))[0]))
    return [Sample(path, q, a, list(turns[:t]), rid, where + (f" (turn {t + 1})" if len(turns) > 1 else ""))
            for t, (q, a) in enumerate(turns)], None


def read_samples(path: str) -> Tuple[List[Sample], List[str]]:
    """Every sample of the JSONL file ``path`` and every problem found (``file:line: what``)."""
    if not os.path.isfile(path):
        raise EmptyDatasetError(f"data file {path} does not exist: pass a .jsonl file (one record per line) "
                                f"or a folder of <label>.jpg images")
    folder = os.path.dirname(os.path.abspath(path))
    samples: List[Sample] = []
    problems: List[str] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}): one record per line")
                continue
            found, problem = _record_samples(record, folder, where)
            if problem:
                problems.append(f"{where}: {problem}")
            samples += found
    return samples, problems


def settle(samples: List[Sample], problems: List[str], path: str, what: str = "record") -> List[Sample]:
    """Apply ``SAT_PATCHES_BAD_RECORDS`` to ``problems`` (``file:line: what``, one per bad record or
    image): ``refuse`` stops at any; ``skip`` reports every one and leaves it out, unless more than
    ``SAT_PATCHES_BAD_RECORDS_MAX`` of them are bad. An empty result is refused either way."""
    if problems:
        listed = "\n  ".join(problems[:SHOWN]) + (f"\n  ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN
                                                 else "")
        try:
            policy = settings.read(SETTING)
        except settings.SettingError as exc:
            raise DataError(str(exc)) from None
        if policy == "refuse":
            raise DataError(f"{len(problems)} {what}(s) of {path} cannot be used:\n  {listed}\nFix them, or set "
                            f"{SETTING}=skip to train without them.")
        total, limit = len(problems) + len(samples), settings.read(MAX_SETTING)
        if samples and len(problems) > limit * total:
            raise DataError(f"{SETTING}=skip, but {len(problems)} of {total} {what}s of {path} "
                            f"({len(problems) / total:.0%}) cannot be used, more than {MAX_SETTING}={limit:g} "
                            f"allows:\n  {listed}\nFix them, or raise {MAX_SETTING} to train on the rest.")
        warnings.warn(f"{SETTING}=skip: left out {len(problems)} of {total} {what}(s) of {path}:\n  "
                      + "\n  ".join(problems), DataWarning, stacklevel=2)
    if not samples:
        raise EmptyDatasetError(f"{path} holds no usable sample" + (" (every record had a problem)" if problems
                                                                     else ": add records, one JSON object per line"))
    return samples


def check_data_path(path: str) -> List[str]:
    """Problems with a training or validation data path before anything is built: a JSONL file is read
    and checked record by record; a folder must hold a readable ``.jpg``. Empty when usable."""
    if path.endswith(".jsonl"):
        try:
            settle(*read_samples(path), path)
        except DataError as exc:
            return [str(exc)]
        return []
    if not os.path.isdir(path):
        return [f"data {path} does not exist: pass a .jsonl file or a folder of <label>.jpg images"]
    images = folder_images(path)
    if not images:
        return [f"data folder {path} holds no readable .jpg image (0 .jpg files): add <label>.jpg images, or pass a "
                f".jsonl file"]
    checked = [(p, image_problem(p)) for p in images]
    try:
        settle([p for p, problem in checked if not problem], [f"{p}: {problem}" for p, problem in checked if problem],
               path, "image")
    except DataError as exc:
        return [str(exc)]
    return []


def folder_images(path: str, suffixes=(".jpg",)) -> List[str]:
    """The images under ``path`` (sorted). Symlinked folders are not entered: a link to a parent
    would make the walk loop."""
    return sorted(os.path.join(d, f) for d, _, files in os.walk(path, followlinks=False)
                  for f in files if f.lower().endswith(suffixes))


def write_jsonl(path: str, records: List[Dict]) -> None:
    """Write ``records`` one per line, atomically (:func:`sat_patches.checkpoints.writer.write_text_atomic`)."""
    from ..checkpoints.writer import write_text_atomic  # the writer imports torch; record checks must not
    write_text_atomic(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
