"""PyTorch's "Getting Started with Distributed RPC Framework" REINFORCE example on
parallax.rpc: an Agent worker holds the policy and RRefs to two Observer workers; each
observer runs an episode in its own environment, asking the agent for every action through
``rpc_sync`` on the agent's RRef; the agent then finishes the episode with a policy-gradient
(REINFORCE) update.

Differences from PyTorch's example, and why:

* No gym: each observer has ``LineWorld``, a tiny deterministic environment written here
  (a walker on the integers -4..4 that moves left or right and is rewarded for being near 0;
  each observer starts somewhere else). CartPole would need gym and a physics step.
* Sampling is reproducible: the action for (episode, observer, step) is drawn with
  ``jax.random.fold_in`` of a fixed key, so it does not depend on the order in which the
  concurrent observers' calls reach the agent; the agent keeps each observer's states and
  actions apart and recomputes their log-probabilities in ``jax.grad`` at the end (JAX keeps
  no tape of the forward, unlike ``m.log_prob(action)`` saved by PyTorch).
* Returns are discounted per observer (PyTorch's example runs the discount across the
  concatenation of all observers' rewards); they are then normalised over all, as there.

The observers run concurrently, yet the run equals one process playing the same episodes
(same rewards, same parameters after every episode, to 1e-6): the policy changes only in
``finish_episode``, after every observer is done.

    python examples/rpc/reinforce.py --steps 3      # 3 episodes

References:
  PyTorch examples, ``distributed/rpc/rl/main.py`` (Observer.run_episode, Agent.select_action,
  Agent.report_reward, Agent.run_episode, Agent.finish_episode); Williams (1992), REINFORCE.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import parallax.rpc as rpc

OBSERVERS = ["observer1", "observer2"]
GAMMA, EPISODE_STEPS, LEARNING_RATE = 0.99, 10, 1e-2


class LineWorld:
    """A deterministic toy environment: position in -4..4, actions 0 (left) and 1 (right),
    reward ``-|position| / 4`` after each move, done on reaching 0."""

    def __init__(self, start: int):
        self.start = start

    def reset(self):
        self.position = self.start
        return self.observe()

    def observe(self):
        return np.array([self.position / 4, 1.0], np.float32)

    def step(self, action: int):
        self.position = int(np.clip(self.position + (1 if action == 1 else -1), -4, 4))
        return self.observe(), -abs(self.position) / 4, self.position == 0


def policy_logits(params, state):
    w1, w2 = params
    return jnp.tanh(state @ w1) @ w2


def choose(params, state, episode: int, observer: int, step: int) -> int:
    """The sampled action for (episode, observer, step): reproducible in any order."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
        jax.random.key(0), episode), observer), step)
    return int(jax.random.categorical(key, policy_logits(params, state)))


def discounted_returns(rewards):
    returns, total = [], 0.0
    for r in reversed(rewards):
        total = r + GAMMA * total
        returns.insert(0, total)
    return returns


def policy_loss(params, states, actions, returns):
    """REINFORCE: ``-sum(log pi(a|s) * R)`` with normalised returns."""
    log_probs = jax.nn.log_softmax(policy_logits(params, states))
    chosen = jnp.take_along_axis(log_probs, actions[:, None], axis=1)[:, 0]
    return -jnp.sum(chosen * returns)


def update(params, opt_state, tx, trajectories):
    """One policy-gradient step on every observer's episode (a dict observer -> lists)."""
    states, actions, returns = [], [], []
    for states_i, actions_i, rewards_i in trajectories:
        states += states_i
        actions += actions_i
        returns += discounted_returns(rewards_i)
    returns = np.asarray(returns, np.float32)
    returns = (returns - returns.mean()) / (returns.std(ddof=1) + np.finfo(np.float32).eps)
    grads = jax.grad(policy_loss)(params, jnp.stack(states), jnp.asarray(actions), returns)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


class Observer:
    """Runs episodes of its own environment, asking the agent for every action."""

    def __init__(self, index: int):
        self.index, self.env = index, LineWorld(start=[-3, 4][index])

    def run_episode(self, agent, episode: int, n_steps: int):
        state = self.env.reset()
        for step in range(n_steps):
            action = agent.rpc_sync().select_action(self.index, state, episode, step)
            state, reward, done = self.env.step(action)
            agent.rpc_sync().report_reward(self.index, reward)
            if done:
                break


class Agent:
    """Holds the policy and an RRef to each observer; runs episodes and updates the policy."""

    def __init__(self, params):
        self.params = [jnp.asarray(p) for p in params]
        self.tx = optax.adam(LEARNING_RATE)
        self.opt_state = self.tx.init(self.params)
        self.me = rpc.RRef(self)
        self.observers = [rpc.remote(name, Observer, args=(i,)) for i, name in enumerate(OBSERVERS)]
        self.trajectories = {}

    def select_action(self, observer: int, state, episode: int, step: int) -> int:
        action = choose(self.params, state, episode, observer, step)
        states, actions, _ = self.trajectories[observer]
        states.append(np.asarray(state))
        actions.append(action)
        return action

    def report_reward(self, observer: int, reward: float) -> None:
        self.trajectories[observer][2].append(reward)

    def run_episode(self, episode: int, n_steps: int = EPISODE_STEPS):
        """Every observer plays one episode (concurrently); returns their rewards."""
        self.trajectories = {i: ([], [], []) for i in range(len(self.observers))}
        rpc.wait_all([ob.rpc_async().run_episode(self.me, episode, n_steps)
                      for ob in self.observers])
        return [self.trajectories[i][2] for i in range(len(self.observers))]

    def finish_episode(self):
        """The REINFORCE update; returns the new parameters."""
        trajectories = [self.trajectories[i] for i in range(len(self.observers))]
        self.params, self.opt_state = update(self.params, self.opt_state, self.tx, trajectories)
        return [np.asarray(p) for p in self.params]


def one_process(params, episodes: int):
    """The same episodes in this process: observers one after the other, same samples."""
    tx = optax.adam(LEARNING_RATE)
    params = [jnp.asarray(p) for p in params]
    opt_state, history = tx.init(params), []
    for episode in range(episodes):
        trajectories = []
        for index in range(len(OBSERVERS)):
            env, states, actions, rewards = LineWorld([-3, 4][index]), [], [], []
            state = env.reset()
            for step in range(EPISODE_STEPS):
                action = choose(params, state, episode, index, step)
                states.append(state)
                actions.append(action)
                state, reward, done = env.step(action)
                rewards.append(reward)
                if done:
                    break
            trajectories.append((states, actions, rewards))
        params, opt_state = update(params, opt_state, tx, trajectories)
        history.append(([t[2] for t in trajectories], [np.asarray(p) for p in params]))
    return history


def main(steps: int = 3) -> None:
    rng = np.random.default_rng(0)
    params = [(rng.normal(size=s) / 2).astype(np.float32) for s in [(2, 16), (16, 2)]]
    rpc.init_rpc("driver", rank=0, world_size=4, worker_names=["driver", "agent", *OBSERVERS])
    agent = rpc.remote("agent", Agent, args=(params,))
    history, running_reward = [], 0.0
    for episode in range(steps):
        rewards = agent.rpc_sync().run_episode(episode)
        history.append((rewards, agent.rpc_sync().finish_episode()))
        running_reward = 0.05 * min(sum(r) for r in rewards) + 0.95 * running_reward
        print(f"episode {episode}: rewards per observer {[round(sum(r), 3) for r in rewards]}, "
              f"running reward {running_reward:.4f}")
    rpc.shutdown()
    for (rewards, got), (want_rewards, want) in zip(history, one_process(params, steps)):
        assert rewards == want_rewards, (rewards, want_rewards)
        for got_leaf, want_leaf in zip(got, want):
            np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-6, atol=1e-7)
    print("REINFORCE over RPC matches one process (rewards and parameters, every episode)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="episodes")
    main(parser.parse_args().steps)
