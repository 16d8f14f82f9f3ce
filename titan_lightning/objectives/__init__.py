"""What a training step minimizes beyond next-token cross entropy: ``preference`` (DPO, IPO, SimPO)."""
