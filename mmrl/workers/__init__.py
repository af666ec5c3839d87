"""Ray worker groups and FSDP2: the policy trained and sampled across processes and nodes."""
