//go:build !ambientd_absent_refuse

package cniplugin

// refuseAbsent is false in every build but one made on purpose with the
// tag ambientd_absent_refuse (docs/soak.md, "Proving the soak fails"):
// while no agent answers, the plugin decides with the install lease and
// the API (whileAbsent), and a pod outside the mesh starts.
const refuseAbsent = false
