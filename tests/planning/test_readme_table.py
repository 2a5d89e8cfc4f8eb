"""The README's recommended-settings table is what `sat-patches plan` recommends, row by row."""
import os
import re

import pytest

from sat_patches.planning import memory, search, shapes

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
MODELS = {"CogVLM": "cogvlm-base-490", "CogAgent": "cogagent-chat"}


def table_rows():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    header = "| model | TRAINABLE | GPUs | MP_SIZE | DS_CONFIG | micro-batch × accumulation |"
    start = text.index(header)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def recommended(model, train, gpus, mem):
    """(MP, DS_CONFIG, (micro-batch, accumulation), GB per GPU, QLoRA, layers left out of checkpointing or "none")
    of the plan's recommendation (upstream's global batch: 4 samples per data-parallel rank)."""
    config = shapes.resolve_model(model)
    best = search.recommend(search.options(config, gpus, mem, train=train, seq_len=shapes.default_seq_len(config)))
    s = best.estimate.setup
    return (s.mp, "zero2_offload.json" if s.offload else "zero2.json", (s.micro_batch, s.accumulation),
            best.estimate.per_gpu / memory.GB, s.qlora, s.checkpoint_skip_layers if s.checkpoint_activations else "none")


@pytest.mark.parametrize("row", table_rows(), ids=lambda r: "-".join(r[:3]).replace(" ", ""))
def test_row_is_the_plans_recommendation(row):
    model, train, gpus, mp, ds_config, micro_batch, skip, per_gpu = row[:8]
    low, high, mem = re.fullmatch(r"(\d+)(?:–(\d+))? × (\d+) GB", gpus).groups()
    counts = [int(low)] + ([int(high)] if high else [])
    batches = [(int(m), int(a)) for m, a in re.findall(r"(\d+) × (\d+)", micro_batch)]
    skips = ["none"] if skip.startswith("none") else [int(k) for k in re.findall(r"(\d+)(?: \(\d+ GPUs\))?", skip)]
    gb = [float(x) for x in per_gpu.split("–")]
    qlora = "QLORA=1" in train
    for i, n in enumerate(counts):
        got = recommended(MODELS[model], train.split(",")[0], n, float(mem))
        assert got[4] == qlora, (n, got)
        want_batch = batches[i] if len(batches) == len(counts) else batches[0]
        assert got[:3] == (int(mp), ds_config.strip("`"), want_batch), (n, got)
        assert got[5] == (skips[i] if len(skips) == len(counts) else skips[0]), (n, got)
        assert min(gb) - 0.6 <= got[3] <= max(gb) + 0.6, (n, got)
