"""Where one launch sits among the job's nodes (torchrun's --nnodes, --node_rank, --master_addr/port)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Nodes:
    """Where one launch sits among the job's nodes: torchrun's --nnodes, --node_rank, --master_addr/--master_port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: any free port (one node only: the other nodes could not know it)

    def problem(self) -> str | None:
        """One line saying what is wrong with these flags, or None."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            return (f"--nnodes must be >= 1 and --node_rank in 0..{self.nnodes - 1} "
                    f"(got {self.nnodes}, {self.node_rank})")
        if not 0 <= self.master_port < 2**16:
            return f"--master_port must be a TCP port, 1..65535 (got {self.master_port})"
        if self.nnodes > 1 and not self.master_port:
            return (f"--nnodes {self.nnodes} needs --master_port: pass the same --master_addr and --master_port "
                    "(a free port on the node of --node_rank 0) to every node's launch")
        return None

    def job(self) -> str:
        """What names this job on every node (the rendezvous address); empty on one node."""
        return f"{self.master_addr}:{self.master_port}" if self.nnodes > 1 else ""

    def who(self, local_rank: int, nproc: int) -> str:
        """A rank's label in the launcher's output: 'rank R', or 'node K rank R' on several nodes (R: global rank)."""
        rank = self.node_rank * nproc + local_rank
        return f"rank {rank}" if self.nnodes == 1 else f"node {self.node_rank} rank {rank}"

    def torchrun_flags(self, port: int) -> list[str]:
        """torchrun's flags for this node (`port` stands in for a master_port of 0)."""
        return ["--nnodes", str(self.nnodes), "--node_rank", str(self.node_rank),
                "--master_addr", self.master_addr, "--master_port", str(self.master_port or port)]


ONE_NODE = Nodes()
