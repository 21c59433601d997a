//go:build !ambientd_trust_restored

package agent

// trustRestored is false in every build but one made on purpose with the
// tag ambientd_trust_restored (docs/soak.md, "Proving the soak fails"):
// the agent verifies every pod it restores after a restart before it is
// ready.
const trustRestored = false
