"""VLA training: a VLM acts in a simulator (`envs/`) by emitting action tokens.

`observations` turns frames into prompts, `episodes` runs groups of episodes in lockstep,
`sft` behaviour-clones scripted demos, `source` makes episodes the rollout source of the trainer's
loop, and `evaluate`
measures success over fixed seeds.
"""
