//go:build ambientd_trust_restored

package agent

// trustRestored, in a build with the tag ambientd_trust_restored only, is a
// known-bad agent for the soak to catch (docs/soak.md, "Proving the soak
// fails"): after a restart it trusts its restored pods' annotations and
// reads none of their rules back before it is ready. Never shipped: the
// default build has trustRestored false (restartverify.go).
const trustRestored = true
