"""Running a scheduled step on the device.

The model runner builds the step's flat batch (`step_inputs`,
`attention_metadata`), runs the model through one ops object (`model_ops`:
torch reference ops or our CUDA kernels), replays CUDA graphs for decode
steps (`cuda_graphs`), keeps tokens sampled but not yet seen by the host on
the device for the steps after (`future_tokens`), profiles and accounts device memory (`gpu_memory`), and
moves device state to the host and back for sleep and wake (`device_state`).
"""
