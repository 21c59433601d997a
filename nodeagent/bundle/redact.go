package bundle

import (
	"regexp"
	"strings"
)

// Redacted replaces a credential in collected text.
const Redacted = "[REDACTED]"

var (
	// bearer: an Authorization header or a "Bearer x" anywhere.
	bearer = regexp.MustCompile(`(?i)(bearer\s+)[A-Za-z0-9\-._~+/]+=*`)
	// jwt: a JSON Web Token (every service account token is one).
	jwt = regexp.MustCompile(`eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*`)
	// credentialField: a key that names a credential, with its value, in
	// JSON, YAML, flag or env form: "token": "x", token: x, --token=x,
	// PASSWORD=x, client-key-data: x.
	credentialField = regexp.MustCompile(`(?i)([\w.-]*(?:token|password|passwd|secret|key-data|private-key|privatekey|apikey|api-key|api_key|credentials?)"?\s*[:=]\s*)("[^"\n]*"|'[^'\n]*'|[^\s,}\]]+)`)
	// credentialName is an environment variable or flag named for a credential.
	credentialName = regexp.MustCompile(`(?i)token|password|passwd|secret|credential|private|apikey|api_key|api-key|key-data`)
)

// Redact removes credentials from collected text: bearer tokens, JSON Web
// Tokens, and the values of fields named for a credential (token,
// password, secret, client-key-data, …). Better one harmless value too
// many than one credential in a ticket.
func Redact(b []byte) []byte {
	b = bearer.ReplaceAll(b, []byte("${1}"+Redacted))
	b = jwt.ReplaceAll(b, []byte(Redacted))
	return credentialField.ReplaceAllFunc(b, func(m []byte) []byte {
		sub := credentialField.FindSubmatch(m)
		v := string(sub[2])
		if strings.Trim(v, `"'`) == "" || strings.Contains(v, Redacted) {
			return m
		}
		return append(append([]byte{}, sub[1]...), `"`+Redacted+`"`...)
	})
}

// SecretName reports whether an environment variable or flag name names
// a credential: its value is never shown.
func SecretName(name string) bool { return credentialName.MatchString(name) }

// LooksSecret reports whether a value looks like a credential by itself
// (a bearer token or a JSON Web Token).
func LooksSecret(v string) bool { return bearer.MatchString(v) || jwt.MatchString(v) }
