"""The stages of one FOCUS iteration, one module each, in the order the flow runs them.

    bootstrap  (once)   tiny model + tokenizer + SFT warm start, or a loaded model   -> policy checkpoint
    evaluate            the same held-out tasks every iteration                      -> evaluation
    rollout             P tasks x G episodes with the current policy                  -> rollouts, episodes
    segment             one state per segment start, with critic features            -> states
    acquire_r{r}        spend a share of the branch budget on the worst-known states  -> acquisition
    branch_r{r}         sample the allocated continuations                            -> branches (+ rollouts)
    fit_critic_r{r}     fit the critic ensemble, combine critic and MC values         -> critic, values
    advantage           TD(lambda) (or the method's estimator) per segment            -> advantages
    update              PPO-clip on the policy tokens                                 -> policy checkpoint, updates

Each module has a plain ``compute(...)`` and a Prefect task that runs it through ``stage.run_stage``
(version, skip-if-committed, commit, one log line). ``inputs`` loads what stages share.
"""
