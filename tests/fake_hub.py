"""A loopback stand-in for the Hugging Face Hub, enough for `huggingface_hub` uploads (create repo, preupload, commit)
and downloads (`resolve`, repo info, tree) so that `push_to_hub` and `from_pretrained("user/repo")` run their real code.

Binds to 127.0.0.1 only, serves from memory, and shuts itself down after `lifetime` seconds even if a test forgets.
"""

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parent.parent


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, list[str]] = {}
        self.messages: dict[str, list[str]] = {}  # each commit's summary, in order
        self.requests: list[str] = []

    def commit_hash(self, repo: str) -> str:
        return (self.commits.get(repo) or ["0" * 40])[-1]


def _handler(hub: FakeHub, endpoint: str):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, payload) -> None:
            self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json"})

        def _missing(self, what: str, head: bool = False) -> None:
            code = "RepoNotFound" if what == "repo" else "EntryNotFound"
            self._send(404, b"{}", {"X-Error-Code": code, "X-Error-Message": f"{what} not found"}, head=head)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_POST(self):
            path = unquote(urlparse(self.path).path)
            hub.requests.append(f"POST {path}")
            body = self._body()
            if path == "/api/repos/create":
                spec = json.loads(body)
                repo = f"{spec.get('organization') or 'user'}/{spec['name']}"
                hub.repos.setdefault(repo, {})
                return self._json(200, {"url": f"{endpoint}/{repo}", "name": repo})
            if path == "/api/validate-yaml":
                return self._json(200, {"errors": [], "warnings": []})
            parts = path.split("/")  # /api/models/{user}/{name}/{action}/{revision}
            if len(parts) >= 6 and parts[1:3] == ["api", "models"]:
                repo, action = f"{parts[3]}/{parts[4]}", parts[5]
                if repo not in hub.repos:
                    return self._missing("repo")
                if action == "preupload":
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    return self._json(200, {"files": modes, "commitOid": hub.commit_hash(repo)})
                if action == "commit":
                    items = [json.loads(line) for line in body.decode().splitlines()]
                    header = next(item["value"] for item in items if item["key"] == "header")
                    parent = header.get("parentCommit")
                    if parent and parent != hub.commit_hash(repo):  # as the Hub: a commit on a stale parent fails
                        return self._send(412, b'{"error": "parent commit is not the head"}')
                    for item in items:
                        value = item["value"]
                        if item["key"] == "header":
                            hub.messages.setdefault(repo, []).append(value["summary"])
                        elif item["key"] == "file":
                            hub.repos[repo][value["path"]] = base64.b64decode(value["content"])
                        elif item["key"] == "deletedFile":
                            hub.repos[repo].pop(value["path"], None)
                    oid = hashlib.sha1(f"{repo}{len(hub.commits.get(repo, []))}".encode()).hexdigest()
                    hub.commits.setdefault(repo, []).append(oid)
                    return self._json(200, {"commitUrl": f"{endpoint}/{repo}/commit/{oid}", "commitOid": oid})
                if action == "branch":
                    return self._json(200, {})
            self._send(404, b"{}")

        def _get(self, head: bool):
            path = unquote(urlparse(self.path).path)
            hub.requests.append(f"{'HEAD' if head else 'GET'} {path}")
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = f"{parts[2]}/{parts[3]}"
                if repo not in hub.repos:
                    return self._missing("repo", head)
                files = hub.repos[repo]
                if len(parts) >= 6 and parts[4] == "tree":  # /api/models/{repo}/tree/{rev}/{folder}
                    folder = "/".join(parts[6:])
                    entries = [
                        {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for f, data in files.items()
                        if not folder or f.startswith(folder + "/")
                    ]
                    return self._missing("folder", head) if folder and not entries else self._json(200, entries)
                siblings = [{"rfilename": f} for f in sorted(files)]
                return self._json(200, {"id": repo, "sha": hub.commit_hash(repo), "siblings": siblings})
            if len(parts) >= 5 and parts[2] == "resolve":  # /{user}/{name}/resolve/{revision}/{file}
                repo, file = f"{parts[0]}/{parts[1]}", "/".join(parts[4:])
                if repo not in hub.repos:
                    return self._missing("repo", head)
                if file not in hub.repos[repo]:
                    return self._missing("file", head)
                data = hub.repos[repo][file]
                headers = {
                    "X-Repo-Commit": hub.commit_hash(repo),
                    "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                    "Content-Type": "application/octet-stream",
                }
                return self._send(200, data, headers, head=head)
            self._send(404, b"{}", head=head)

        def do_GET(self):
            self._get(head=False)

        def do_HEAD(self):
            self._get(head=True)

    return Handler


@contextmanager
def fake_hub(lifetime: float = 600.0) -> Iterator[tuple[str, FakeHub]]:
    """Yields `(endpoint, hub)`: set `HF_ENDPOINT=endpoint` (and any `HF_TOKEN`, and `HF_HUB_DISABLE_XET=1`)."""
    hub = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), None)
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    server.RequestHandlerClass = _handler(hub, endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    deadline = threading.Timer(lifetime, server.shutdown)
    deadline.daemon = True
    deadline.start()
    try:
        yield endpoint, hub
    finally:
        deadline.cancel()
        server.shutdown()
        server.server_close()


def hub_env(endpoint: str) -> dict[str, str]:
    """What a process needs to talk to the fake Hub at `endpoint` as a logged-in user."""
    return {"HF_ENDPOINT": endpoint, "HF_TOKEN": "hf_fake", "HF_HUB_DISABLE_XET": "1"}


def run_against_hub(code: str, env: dict, tmp_path: Path) -> str:
    """Runs `code` in a fresh interpreter that talks to the fake Hub (huggingface_hub reads HF_ENDPOINT at import);
    returns its stdout, failing the test with its stderr if it fails."""
    run_env = {**os.environ, **env, "HF_HOME": str(tmp_path / "hf-home"), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=run_env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
