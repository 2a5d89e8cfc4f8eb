"""The CAPTCHA data set without the optional ``captcha`` package: an error naming the extra that installs it."""
import sys

import pytest

from sat_patches.cogvlm import captcha_data


def test_without_captcha_the_error_names_the_demo_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "captcha", None)  # None in sys.modules: `import captcha` raises ImportError
    monkeypatch.setitem(sys.modules, "captcha.image", None)
    with pytest.raises(ImportError, match=r'pip install "sat_patches\[demo\]"'):
        captcha_data.make_captcha_dataset(str(tmp_path / "train"), 2)
    assert not (tmp_path / "train").exists()  # nothing written before the error
