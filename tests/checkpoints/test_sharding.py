"""Copying out of a mapped checkpoint file: what the kernel is told about each chunk."""
import torch

from sat_patches.checkpoints import sharding


def test_each_mapped_chunk_is_mapped_at_once_then_released_and_a_large_host_destination_gets_huge_pages(
        tmp_path, monkeypatch):
    path = str(tmp_path / "t.pt")
    torch.save({"w": torch.arange(4 * 2**20, dtype=torch.float32).reshape(1024, 4096)}, path)  # 16 MiB
    src = torch.load(path, mmap=True, weights_only=True)["w"]
    calls = []
    monkeypatch.setattr(sharding, "_advise", lambda view, advice: calls.append((advice, view.numel())))
    monkeypatch.setattr(sharding, "CHUNK_BYTES", 4 * 2**20)
    dst = torch.empty_like(src)
    sharding._copy(dst, src, mapped=True)
    assert torch.equal(dst, src)
    chunk = 256 * 4096
    assert calls == [(sharding._MADV_HUGEPAGE, src.numel())] + [
        (sharding._MADV_POPULATE_READ, chunk), (sharding._MADV_DONTNEED, chunk)] * 4
    calls.clear()
    small = torch.empty(8, 8)
    sharding._copy(small, torch.ones(8, 8), mapped=False)  # not mapped, under 2 MiB: no advice
    assert calls == [] and torch.equal(small, torch.ones(8, 8))
