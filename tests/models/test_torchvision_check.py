"""A torchvision that is installed but cannot load is hidden from transformers
(models.torchvision_check); one that loads, or none, is left alone. Each case runs in a fresh
interpreter with a stand-in torchvision package first on its path."""

import subprocess
import sys
import textwrap


def _check(tmp_path, body: str, transformers_first: bool = False) -> tuple[list[str], str]:
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text(body)
    # a script may import transformers (and ask it whether torchvision is there) before reelflow
    first = "import transformers.utils.import_utils as iu; iu.is_torchvision_available()" if transformers_first else ""
    code = textwrap.dedent(f"""
        import importlib.util, sys
        {first}
        import models      # the package runs the check when first imported
        print(sys.modules.get("torchvision", "absent") is None, importlib.util.find_spec("torchvision") is None)
        import transformers.utils.import_utils as iu
        print(iu.is_torchvision_available())
    """)
    done = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": f"{tmp_path}:.", "PATH": ""},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split(), done.stderr


def test_an_unloadable_torchvision_is_hidden(tmp_path):
    out, err = _check(tmp_path, 'raise RuntimeError("operator torchvision::nms does not exist")\n')
    assert out == ["True", "True", "False"]
    assert "torchvision" not in err      # harmless to reelflow: a debug note, not a warning on every run


def test_an_unloadable_torchvision_is_hidden_after_transformers_said_it_was_there(tmp_path):
    out, _ = _check(tmp_path, 'raise RuntimeError("operator torchvision::nms does not exist")\n',
                    transformers_first=True)
    assert out == ["True", "True", "False"]      # its cached "yes" is forgotten


def test_a_loadable_torchvision_stays(tmp_path):
    assert _check(tmp_path, '__version__ = "0.0"\n')[0][:2] == ["False", "False"]
