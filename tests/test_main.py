"""`python -m attn_qat`, the README's first command: it passes, prints its seed, explains the demo's FP4 error, and
prints no warnings."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_job_is_clean_and_repeatable():
    env = dict(os.environ, ATTN_QAT_SEED="1234", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-W", "default", "-m", "attn_qat"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "seed 1234" in run.stdout and "Self-check passed." in run.stdout
    assert "expected" in run.stdout and "QAT training" in run.stdout
    assert "Warning" not in run.stderr and "warn" not in run.stdout.lower(), run.stderr
