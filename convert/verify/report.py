"""What verify-manifest found: the named checks, each with its problems."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: output file -> its sha256 (hex), read with its manifest digest and matching it (``verify(hub=True)``): what
    #: the Hub's LFS names it by, for a manifest that records BLAKE3
    sha256: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems and all(ok for _, ok, _ in self.checks)

    def check(self, name: str, problems: list[str], detail: str = "") -> None:
        self.checks.append((name, not problems, detail))
        self.problems += problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in self.checks],
                "problems": self.problems}
