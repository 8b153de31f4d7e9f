"""PPO on ForkVectorEnv, in one file, in the style of CleanRL: read it top to bottom.

What differs from a CleanRL ``ppo.py``:

1. ``gym.vector.SyncVectorEnv(...)`` became ``ForkVectorEnv(...)``: every sub-env runs in
   its own sandbox, stepped over shared memory.
2. Every ``--eval-every`` iterations the current policy is evaluated on a *branch* of the
   live training envs (``envs.fork``): copies of a running sub-env, reset with fixed
   seeds, played greedily to the end of an episode, then closed. Nothing is built for
   evaluation and the training envs are not touched: a second branch (the "witness"),
   stepped with the training envs' next actions, must give exactly their next results.

Run: ``python examples/ppo_cleanrl.py --total-timesteps 50000`` (needs torch).
"""

from __future__ import annotations

import argparse
import random
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn, optim
from torch.distributions.categorical import Categorical

from gym_fork import ForkVectorEnv


def parse_args() -> argparse.Namespace:
    """Command-line settings; the defaults solve CartPole-v1 in about 50k steps."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=50_000)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=128, help="steps per env per rollout")
    p.add_argument("--learning-rate", type=float, default=2.5e-3)
    p.add_argument("--anneal-lr", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=10, help="iterations between evals")
    p.add_argument("--eval-episodes", type=int, default=4)
    args = p.parse_args()
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    return args


def make_env(env_id: str):
    """An env_fn: runs inside a sandbox, so it must be picklable (no open handles)."""

    def thunk() -> gym.Env:
        env = gym.make(env_id)
        return gym.wrappers.RecordEpisodeStatistics(env)

    return thunk


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """Orthogonal weights, constant bias: the usual PPO initialisation."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Separate actor and critic MLPs over a flat observation."""

    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),
        )

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        """V(s)."""
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None):
        """Sample (or score) an action; return it, its log-prob, the entropy and V(s)."""
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """The most likely action: what evaluation plays."""
        return self.actor(x).argmax(dim=-1)


def evaluate_on_branch(
    envs: ForkVectorEnv, agent: Agent, iteration: int, episodes: int, seed: int
) -> list[float]:
    """Play ``episodes`` greedy episodes on a branch of training sub-env 0, then close it.

    The branch holds copies of sub-env 0's sandbox as it is right now (same wrappers,
    same config); ``reset(seed=...)`` starts each copy on a fixed evaluation episode, so
    evaluations at different iterations are comparable.
    """
    branch = envs.fork(f"eval-{iteration}", indices=[0], copies=episodes)
    try:
        obs, _ = branch.reset(seed=seed)
        returns = np.zeros(episodes)
        finished = np.zeros(episodes, dtype=bool)
        while not finished.all():
            with torch.no_grad():
                action = agent.greedy(torch.as_tensor(obs, dtype=torch.float32))
            obs, reward, term, trunc, _ = branch.step(action.numpy())
            returns += reward * ~finished  # a finished copy autoresets: ignore its steps
            finished |= term | trunc
        return returns.tolist()
    finally:
        branch.close()


def main() -> None:
    args = parse_args()
    run_start = time.time()

    # Seeding, as CleanRL does, so a run can be repeated.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    torch.set_num_threads(1)  # a small MLP: threads cost more than they give
    device = torch.device("cpu")

    # The one-line swap: this was `gym.vector.SyncVectorEnv([...])`.
    # SAME_STEP autoreset: a finished sub-env returns its next episode's first observation
    # in the same step (as gym < 1.0 did), which is what the GAE loop below assumes.
    envs = ForkVectorEnv(
        [make_env(args.env_id) for _ in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "discrete actions only"

    obs_dim = int(np.prod(envs.single_observation_space.shape))
    agent = Agent(obs_dim, int(envs.single_action_space.n)).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    # Rollout storage.
    obs = torch.zeros((args.num_steps, args.num_envs, obs_dim)).to(device)
    actions = torch.zeros((args.num_steps, args.num_envs)).to(device)
    logprobs = torch.zeros((args.num_steps, args.num_envs)).to(device)
    rewards = torch.zeros((args.num_steps, args.num_envs)).to(device)
    dones = torch.zeros((args.num_steps, args.num_envs)).to(device)
    values = torch.zeros((args.num_steps, args.num_envs)).to(device)

    global_step = 0
    start_time = time.time()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.Tensor(next_obs).to(device)
    next_done = torch.zeros(args.num_envs).to(device)
    witness: ForkVectorEnv | None = None
    recent_returns: list[float] = []

    try:
        for iteration in range(1, args.num_iterations + 1):
            # Evaluate on branches of the live envs, and leave a witness of their state.
            if iteration == 1 or iteration % args.eval_every == 0:
                witness = envs.fork(f"witness-{iteration}")
                eval_returns = evaluate_on_branch(
                    envs, agent, iteration, args.eval_episodes, seed=10_000 + args.seed
                )
                print(
                    f"eval iteration={iteration} global_step={global_step} "
                    f"mean_return={np.mean(eval_returns):.1f} "
                    f"returns={[round(r) for r in eval_returns]}",
                    flush=True,
                )

            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / args.num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # Collect a rollout.
            for step in range(args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done

                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                    values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob

                step_actions = action.cpu().numpy()
                next_obs_np, reward, terminations, truncations, infos = envs.step(step_actions)

                if witness is not None:
                    # The witness forked before the evaluation and sees the same actions:
                    # equal results show that evaluating left the training envs untouched.
                    w_obs, w_reward, w_term, w_trunc, _ = witness.step(step_actions)
                    same = (
                        np.array_equal(w_obs, next_obs_np)
                        and np.array_equal(w_reward, reward)
                        and np.array_equal(w_term, terminations)
                        and np.array_equal(w_trunc, truncations)
                    )
                    print(f"training envs undisturbed by the evaluation: {same}", flush=True)
                    witness.close()
                    witness = None

                next_done_np = np.logical_or(terminations, truncations)
                rewards[step] = torch.tensor(reward).to(device).view(-1)
                next_obs = torch.Tensor(next_obs_np).to(device)
                next_done = torch.Tensor(next_done_np).to(device)

                # With SAME_STEP, RecordEpisodeStatistics' numbers sit in final_info.
                if "final_info" in infos and "episode" in infos["final_info"]:
                    episode = infos["final_info"]["episode"]
                    for i in np.flatnonzero(infos["final_info"]["_episode"]):
                        recent_returns.append(float(episode["r"][i]))

            # Generalised advantage estimation, bootstrapped from the last observation.
            with torch.no_grad():
                next_value = agent.get_value(next_obs).reshape(1, -1)
                advantages = torch.zeros_like(rewards).to(device)
                lastgaelam = 0
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        nextnonterminal = 1.0 - next_done
                        nextvalues = next_value
                    else:
                        nextnonterminal = 1.0 - dones[t + 1]
                        nextvalues = values[t + 1]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                    advantages[t] = lastgaelam
                returns = advantages + values

            # Flatten the batch.
            b_obs = obs.reshape((-1, obs_dim))
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape(-1)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)

            # Optimise the policy and value network.
            b_inds = np.arange(args.batch_size)
            clipfracs = []
            for _epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, args.batch_size, args.minibatch_size):
                    mb_inds = b_inds[start : start + args.minibatch_size]

                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        b_obs[mb_inds], b_actions.long()[mb_inds]
                    )
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()
                    with torch.no_grad():
                        clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean())

                    mb_advantages = b_advantages[mb_inds]
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (
                        mb_advantages.std() + 1e-8
                    )

                    # Clipped policy loss.
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(
                        ratio, 1 - args.clip_coef, 1 + args.clip_coef
                    )
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                    # Clipped value loss.
                    newvalue = newvalue.view(-1)
                    v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                    v_clipped = b_values[mb_inds] + torch.clamp(
                        newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef
                    )
                    v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                    v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()

                    loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()

            sps = int(global_step / (time.time() - start_time))
            train_return = np.mean(recent_returns[-20:]) if recent_returns else float("nan")
            print(
                f"iteration={iteration} global_step={global_step} "
                f"train_return={train_return:.1f} clipfrac={np.mean(clipfracs):.3f} SPS={sps}",
                flush=True,
            )

        final = evaluate_on_branch(
            envs, agent, args.num_iterations + 1, args.eval_episodes, seed=10_000 + args.seed
        )
        print(
            f"eval final global_step={global_step} mean_return={np.mean(final):.1f} "
            f"returns={[round(r) for r in final]} wall={time.time() - run_start:.1f}s",
            flush=True,
        )
    finally:
        if witness is not None:
            witness.close()
        envs.close()


if __name__ == "__main__":
    main()
