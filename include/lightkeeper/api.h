// LK_API marks what liblightkeeper.so exports. The library and everything linked into it are
// built with hidden visibility, so a declaration without LK_API (a private member, an internal
// function of the same namespace) stays inside the library and users cannot come to depend on it.
// Thread-safety: a macro.
#pragma once

#define LK_API __attribute__((visibility("default")))
