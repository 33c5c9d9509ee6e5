"""`cmake --install` gives a nopad that runs from anywhere: PREFIX/bin/nopad, the shipped vocabulary and model configs
in PREFIX/share/nopad/data (found from the binary's own location, whatever the working directory), the example
configs and the Python helpers. Then, from an unrelated working directory: prepare with the installed vocabulary,
train from a config file in another folder whose relative paths resolve against that folder (the run's config.toml
records them absolute), convert a TensorFlow checkpoint with the default vocabulary found in the installation, and
read the shards with the installed nopad_shards.py."""
import os
import shutil
import subprocess
import sys
import tempfile

from nopad_checks import check, failures

NOPAD = os.environ["NOPAD_BINARY"]
SRC = os.environ["NOPAD_SOURCE_DIR"]
BUILD = os.path.dirname(NOPAD)


def main():
    tmp = tempfile.mkdtemp(prefix="nopad-install-")
    try:
        prefix = os.path.join(tmp, "prefix")
        r = subprocess.run(["cmake", "--install", BUILD, "--prefix", prefix], capture_output=True, text=True)
        check(r.returncode == 0, f"cmake --install: {r.stderr[-500:]}")
        exe = os.path.join(prefix, "bin", "nopad")
        share = os.path.join(prefix, "share", "nopad")
        for rel in ("data/vocab/bert-uncased-vocab.txt", "data/configs/bert-tiny.json", "configs/quickstart.toml",
                    "python/nopad_shards.py"):
            check(os.path.isfile(os.path.join(share, rel)), f"installed {rel}")
        elsewhere = os.path.join(tmp, "elsewhere")
        os.makedirs(elsewhere)
        run = lambda *a: subprocess.run([exe, *a], capture_output=True, text=True, cwd=elsewhere)  # noqa: E731
        r = run("--version")
        check(r.returncode == 0 and r.stdout.startswith("nopad "), f"installed nopad --version: {r.stdout}{r.stderr}")

        data = os.path.join(tmp, "work", "data")
        r = run("prepare", "--input", os.path.join(SRC, "data/wiki-sample/wiki_00"), "--vocab",
                os.path.join(share, "data/vocab/bert-uncased-vocab.txt"), "--output", data, "--max-seq-length", "64",
                "--max-predictions", "10", "--dupe-factor", "1", "--quiet")
        check(r.returncode == 0, f"prepare: {r.stderr}")

        cfg_dir = os.path.join(tmp, "work", "configs")
        os.makedirs(cfg_dir)
        cfg = os.path.join(cfg_dir, "run.toml")
        with open(cfg, "w") as f:
            f.write('run_dir = "../run"\n'
                    f'model.config = "{os.path.relpath(os.path.join(share, "data/configs/bert-tiny.json"), cfg_dir)}"\n'
                    '[data]\ntrain = "../data"\n[train]\ndevice = "cpu"\nglobal_batch = 8\nmax_steps = 3\n')
        r = run("train", "--config", cfg)
        check(r.returncode == 0, f"train --config from another folder: {r.stderr[-400:]}")
        recorded = open(os.path.join(tmp, "work", "run", "config.toml")).read()
        check(f'train = "{data}"' in recorded and f'run_dir = "{os.path.join(tmp, "work", "run")}"' in recorded,
              "the run's config.toml records the resolved absolute paths")

        out = os.path.join(tmp, "converted")
        r = run("convert", "--from-tf-checkpoint", os.path.join(SRC, "tests/data/tf-bert-checkpoint"), "--output", out)
        check(r.returncode == 0 and "nopad's default" in r.stdout, f"convert finds the installed vocabulary: {r.stdout}"
                                                                    f"{r.stderr}")
        if r.returncode == 0:
            check(open(os.path.join(out, "vocab.txt")).read() ==
                  open(os.path.join(share, "data/vocab/bert-uncased-vocab.txt")).read(), "the installed vocabulary")

        r = subprocess.run([sys.executable, "-c", f"import nopad_shards; print(len(nopad_shards.open_dataset({data!r})))"],
                           capture_output=True, text=True, cwd=elsewhere,
                           env={**os.environ, "PYTHONPATH": os.path.join(share, "python")})
        check(r.returncode == 0 and int(r.stdout.strip() or 0) > 0, f"installed nopad_shards.py reads the shards: "
                                                                     f"{r.stdout}{r.stderr}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("install checks passed")


if __name__ == "__main__":
    main()
