//go:build !ambientd_absent_admit

package cniplugin

// admitAbsent is false in every build but one made on purpose with the tag
// ambientd_absent_admit (docs/soak.md, "Proving the soak fails"): while no
// agent answers, the plugin decides with the install lease and the API
// (whileAbsent), and a pod in the mesh waits for the agent.
const admitAbsent = false
