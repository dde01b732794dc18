"""DuoAttention (Xiao et al., 2024): the policy (policy.py), its gates' training (gates.py) and the synthetic
passkeys they are trained on (data.py)."""
