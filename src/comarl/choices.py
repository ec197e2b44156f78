"""Names of the algorithm options, shared by the configs (no torch) and the tensor math."""

BASELINES = ("group_mean", "none", "leave_one_out", "group_max", "greedy")
SCALES = ("group", "batch", "turn", "none")
# Baselines whose advantages shrink with the spread of the returns: the only ones a scale may divide.
CENTRED_BASELINES = ("group_mean", "leave_one_out", "group_max")
AGGREGATIONS = ("grpo", "dr_grpo", "dapo")
PAIR_SELECTIONS = ("reward_gap", "random", "all")
# Where the beta-weighted KL to the reference goes: k3 per token in the loss, or k1 per completion off the reward.
KL_PENALTIES = ("loss", "reward")
