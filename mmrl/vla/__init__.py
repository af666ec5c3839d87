"""VLA training: a VLM acts in a simulator (`mmrl.envs`) by emitting action tokens, or action chunks from a
continuous head or flow-matching expert on its backbone (`mmrl.models.action_head`).

`observations` turns frames into prompts, `episodes` runs groups of episodes in lockstep, and `sft`
behaviour-clones scripted demos. `mmrl.sources.episodes` makes episodes the trainer's rollout source,
and `mmrl.evaluate.episodes` measures success over fixed seeds.
"""
